// The pipeline view: GET /stages once a second while the page is visible; one card per stage (its layers,
// place, health, heartbeat, memory, lanes, restarts, and where a token's time goes), the slowest one marked,
// and the gateway's figures over the last minutes.

import { KeyNeeded, errorText, request } from "./api.js";
import { Series, draw } from "./chart.js";

const $ = (id) => document.getElementById(id);
const POLL_MS = 1000;
const FIGURES = ["queue_depth", "active_sessions", "prompt_cache_hits", "tokens_per_second"];
const SEGMENTS = [ // a bar's parts: class, label, the split's fields
  ["compute", "compute", ["compute_us"]],
  ["encode", "encode", ["encode_us", "decode_us"]],
  ["link", "link", ["link_us"]],
  ["queue", "queue", ["queue_us"]],
];
const ROWS = [["layers", "layers"], ["host", "host"], ["endpoint", "endpoint"], ["heartbeat", "heartbeat"],
              ["rss", "memory"], ["lanes", "lanes in use"], ["restarts", "restarts"]];

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) {
    node.className = className;
  }
  if (text !== undefined) {
    node.textContent = text;
  }
  return node;
}

/** "312 MiB", "1.2 GiB"; "-" when unknown. */
function bytes(value) {
  if (value === null || value === undefined) {
    return "-";
  }
  const mib = value / 2 ** 20;
  return mib >= 1024 ? `${(mib / 1024).toFixed(2)} GiB` : `${Math.round(mib)} MiB`;
}

/** µs as "850 µs" or "1.25 ms". */
function micros(value) {
  return value >= 1000 ? `${(value / 1000).toFixed(2)} ms` : `${Math.round(value)} \u00b5s`;
}

/** One stage's card: made once, its fields filled at every poll. */
class StageCard {
  constructor(index) {
    this.node = element("article", "stage");
    this.node.dataset.stage = String(index);
    const header = element("header");
    this.title = element("h3");
    this.state = element("span", "badge state");
    this.state.dataset.field = "state";
    this.slow = element("span", "badge slow", "slowest");
    this.slow.hidden = true;
    header.append(this.title, this.slow, this.state);
    const list = element("dl");
    this.fields = {};
    for (const [field, label] of ROWS) {
      const value = element("dd");
      value.dataset.field = field;
      this.fields[field] = value;
      list.append(element("dt", "", label), value);
    }
    const track = element("div", "bar-track");
    this.bar = element("div", "bar");
    this.bar.dataset.field = "bar";
    this.segments = {};
    for (const [name] of SEGMENTS) {
      this.segments[name] = element("span", name);
      this.bar.append(this.segments[name]);
    }
    track.append(this.bar);
    this.split = element("p", "split-text");
    this.split.dataset.field = "split";
    this.detail = element("p", "detail");
    this.detail.dataset.field = "detail";
    this.node.append(header, list, track, this.split, this.detail);
  }

  update(stage, longest) {
    this.node.dataset.state = stage.state;
    this.node.classList.toggle("slowest", stage.slowest);
    this.slow.hidden = !stage.slowest;
    this.title.textContent = `stage ${stage.index} \u00b7 ${stage.id}`;
    this.state.textContent = stage.state.replace("_", " ");
    this.state.dataset.state = stage.state;
    const f = this.fields;
    f.layers.textContent = stage.layer_start === null ? "-" : `[${stage.layer_start}, ${stage.layer_end})`;
    f.host.textContent = stage.host || "-";
    f.endpoint.textContent = stage.endpoint || "-";
    f.heartbeat.textContent = stage.heartbeat_age_s === null ? "none yet" : `${stage.heartbeat_age_s.toFixed(1)} s ago`;
    f.rss.textContent = bytes(stage.rss_bytes);
    f.lanes.textContent = stage.lanes_in_use === null ? "-" : `${stage.lanes_in_use} of ${stage.lane_count ?? "?"}`;
    f.restarts.textContent = String(stage.restarts);
    this.detail.textContent = stage.detail;
    this.draw(stage.token_split, longest);
  }

  draw(split, longest) {
    if (!split) {
      this.bar.style.width = "0";
      this.split.textContent = "no token in the window";
      return;
    }
    // CSSOM properties, not style attributes: the page's policy allows no inline style
    this.bar.style.width = `${longest > 0 ? Math.max(2, (100 * split.total_us) / longest) : 0}%`;
    const parts = SEGMENTS.map(([name, label, fields]) => {
      const value = fields.reduce((sum, field) => sum + split[field], 0);
      this.segments[name].style.flexGrow = String(value);
      this.segments[name].style.flexBasis = "0";
      this.segments[name].title = `${label} ${micros(value)}`;
      return `${label} ${micros(value)}`;
    });
    this.split.textContent = `${micros(split.total_us)} per token (${split.tokens} tokens): ${parts.join(", ")}`;
  }
}

export class Pipeline {
  constructor() {
    this.cards = new Map();
    this.series = Object.fromEntries(FIGURES.map((name) => [name, new Series()]));
    this.timer = null;
    this.stopped = true;
    document.addEventListener("visibilitychange", () => (document.hidden ? this.pause() : this.start()));
  }

  start() {
    if (!this.stopped || document.hidden) {
      return;
    }
    this.stopped = false;
    this.poll();
  }

  pause() {
    this.stopped = true;
    clearTimeout(this.timer);
  }

  async poll() {
    if (this.stopped) {
      return;
    }
    let wait = POLL_MS;
    try {
      const response = await request("stages");
      if (!response.ok) {
        throw new Error(await errorText(response));
      }
      this.render(await response.json());
    } catch (error) {
      if (error instanceof KeyNeeded) {
        this.stopped = true; // until a key is given: app.js starts the polls again
        this.status("error", "API key needed", error.message);
        return;
      }
      this.status("error", "unreachable", error.message);
      wait = 2 * POLL_MS;
    }
    clearTimeout(this.timer);
    this.timer = setTimeout(() => this.poll(), wait);
  }

  status(state, text, title) {
    const badge = $("status");
    badge.dataset.state = state;
    badge.textContent = text;
    badge.title = title || "";
  }

  render(body) {
    this.status(body.status, body.status === "ok" ? "ready" : body.status, body.message);
    $("model").textContent = body.model;
    $("window").textContent = String(body.window_s);
    $("pipeline-message").textContent = body.status === "ok" ? "" : body.message;
    for (const name of FIGURES) {
      const value = body.gateway[name];
      this.series[name].push(value);
      const figure = document.querySelector(`.figure[data-figure="${name}"]`);
      figure.querySelector(".value").textContent = Number.isInteger(value) ? String(value) : value.toFixed(1);
      if (!$("view-pipeline").hidden) {
        draw(figure.querySelector("canvas"), this.series[name]);
      }
    }
    this.renderStages(body.stages);
  }

  renderStages(stages) {
    const longest = Math.max(0, ...stages.map((stage) => (stage.token_split ? stage.token_split.total_us : 0)));
    const seen = new Set();
    for (const stage of stages) {
      let card = this.cards.get(stage.index);
      if (!card) {
        card = new StageCard(stage.index);
        this.cards.set(stage.index, card);
        $("stages").append(card.node);
      }
      card.update(stage, longest);
      seen.add(stage.index);
    }
    for (const [index, card] of this.cards) {
      if (!seen.has(index)) {
        card.node.remove();
        this.cards.delete(index);
      }
    }
  }

  /** Draw the charts now (the view just became visible: they are not drawn while hidden). */
  redraw() {
    for (const name of FIGURES) {
      draw(document.querySelector(`.figure[data-figure="${name}"] canvas`), this.series[name]);
    }
  }
}
