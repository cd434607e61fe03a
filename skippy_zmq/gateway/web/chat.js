// The chat view: messages streamed as they come, through /v1/chat/completions (the model's chat template) or
// /v1/completions (plain text). Whatever the model or the server says is shown as text (textContent), never
// parsed as HTML.

import { KeyNeeded, errorText, events, request } from "./api.js";

const $ = (id) => document.getElementById(id);

/** A number field's value, or undefined when it is empty (the server's default then applies). */
function numberField(id, integer) {
  const text = $(id).value.trim();
  if (text === "") {
    return undefined;
  }
  const value = Number(text);
  if (!Number.isFinite(value) || (integer && !Number.isInteger(value))) {
    throw new Error(`${id} must be ${integer ? "an integer" : "a number"}, not ${text}`);
  }
  return value;
}

/** The sampling fields of a request, from the settings (empty fields left out). */
function sampling() {
  const fields = {
    temperature: numberField("temperature", false), top_p: numberField("top_p", false),
    top_k: numberField("top_k", true), min_p: numberField("min_p", false),
    max_tokens: numberField("max_tokens", true), seed: numberField("seed", true),
  };
  return Object.fromEntries(Object.entries(fields).filter(([, value]) => value !== undefined));
}

/** A new message in the list: its element and the parts the stream fills. */
function messageElement(role, text) {
  const item = document.createElement("li");
  item.className = `message ${role}`;
  item.dataset.role = role;
  const label = document.createElement("div");
  label.className = "role";
  label.textContent = role;
  const thought = document.createElement("div");
  thought.className = "thought";
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = text;
  const stats = document.createElement("div");
  stats.className = "stats";
  item.append(label, thought, content, stats);
  $("messages").append(item);
  item.scrollIntoView({ block: "end" });
  return { item, thought, content, stats };
}

/** "123 ms", "1.23 s". */
function duration(ms) {
  return ms < 1000 ? `${Math.round(ms)} ms` : `${(ms / 1000).toFixed(2)} s`;
}

export class Chat {
  constructor() {
    this.history = []; // {role, content}: what the next request sends (chat mode)
    this.lastPrompt = null; // completion mode: the prompt regenerate sends again
    this.controller = null;
    $("composer").addEventListener("submit", (event) => {
      event.preventDefault();
      this.send();
    });
    $("prompt").addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        this.send();
      }
    });
    $("stop").addEventListener("click", () => this.stop());
    $("regenerate").addEventListener("click", () => this.regenerate());
    $("clear").addEventListener("click", () => this.clear());
    $("mode").addEventListener("change", () => this.clear());
  }

  get mode() {
    return $("mode").value;
  }

  clear() {
    this.stop();
    this.history = [];
    this.lastPrompt = null;
    $("messages").replaceChildren();
    $("chat-error").textContent = "";
    $("regenerate").disabled = true;
  }

  send() {
    const text = $("prompt").value;
    if (this.controller || !text.trim()) {
      return;
    }
    $("prompt").value = "";
    messageElement("user", text);
    if (this.mode === "chat") {
      this.history.push({ role: "user", content: text });
    } else {
      this.lastPrompt = text;
    }
    this.generate();
  }

  regenerate() {
    if (this.controller) {
      return;
    }
    const items = $("messages").querySelectorAll(".message.assistant");
    const last = items[items.length - 1];
    if (!last || last !== $("messages").lastElementChild) {
      return;
    }
    last.remove();
    if (this.mode === "chat" && this.history.length && this.history[this.history.length - 1].role === "assistant") {
      this.history.pop();
    }
    this.generate();
  }

  stop() {
    if (this.controller) {
      this.controller.abort();
    }
  }

  /** The request's path and body for the current mode and settings. */
  body() {
    const base = { stream: true, stream_options: { include_usage: true }, ...sampling() };
    const system = $("system").value.trim();
    if (this.mode === "chat") {
      const messages = system ? [{ role: "system", content: system }, ...this.history] : [...this.history];
      return ["v1/chat/completions", { ...base, messages }];
    }
    const prompt = system ? `${system}\n\n${this.lastPrompt}` : this.lastPrompt;
    return ["v1/completions", { ...base, prompt }];
  }

  async generate() {
    $("chat-error").textContent = "";
    let path, body;
    try {
      [path, body] = this.body();
    } catch (error) {
      $("chat-error").textContent = error.message;
      return;
    }
    const view = messageElement("assistant", "");
    view.item.dataset.state = "streaming";
    const controller = new AbortController();
    this.controller = controller;
    this.busy(true);
    const run = { started: performance.now(), first: null, last: null, chunks: 0, tokens: null, text: "" };
    try {
      const response = await request(path, { method: "POST", body: JSON.stringify(body),
                                              headers: { "Content-Type": "application/json" },
                                              signal: controller.signal });
      if (!response.ok) {
        throw new Error(await errorText(response));
      }
      for await (const chunk of events(response)) {
        this.take(chunk, run, view);
      }
      view.item.dataset.state = "done";
    } catch (error) {
      if (error.name === "AbortError") {
        view.item.dataset.state = "stopped";
      } else {
        view.item.dataset.state = "error";
        $("chat-error").textContent = error instanceof KeyNeeded ? `${error.message}: enter it above` : error.message;
      }
    } finally {
      this.controller = null;
      this.busy(false);
      this.finish(run, view);
    }
  }

  /** One streamed chunk: text to show, the usage, or an error the server sent after the stream began. */
  take(chunk, run, view) {
    if (chunk.error) {
      throw new Error(chunk.error.message || "the server reported an error");
    }
    if (chunk.usage && typeof chunk.usage.completion_tokens === "number") {
      run.tokens = chunk.usage.completion_tokens;
    }
    const choice = (chunk.choices || [])[0];
    if (!choice) {
      return;
    }
    const piece = this.mode === "chat" ? (choice.delta || {}).content : choice.text;
    const thought = this.mode === "chat" ? (choice.delta || {}).reasoning_content : null;
    const now = performance.now();
    if (typeof thought === "string" && thought) {
      run.first = run.first ?? now;
      view.thought.textContent += thought;
    }
    if (typeof piece === "string" && piece) {
      run.first = run.first ?? now;
      run.last = now;
      run.chunks += 1;
      run.text += piece;
      view.content.textContent = run.text;
    }
  }

  /** The message's figures (time to first token, tokens/s, tokens); the answer joins the history. */
  finish(run, view) {
    const tokens = run.tokens ?? run.chunks;
    const parts = [];
    if (run.first !== null) {
      const ttft = run.first - run.started;
      view.stats.dataset.ttftMs = String(Math.round(ttft));
      parts.push(`first token ${duration(ttft)}`);
    }
    if (tokens > 1 && run.last !== null && run.last > run.first) {
      const rate = (tokens - 1) / ((run.last - run.first) / 1000);
      view.stats.dataset.tokensPerSecond = rate.toFixed(1);
      parts.push(`${rate.toFixed(1)} tokens/s`);
    }
    view.stats.dataset.tokens = String(tokens);
    parts.push(`${tokens} tokens`);
    if (view.item.dataset.state === "stopped") {
      parts.push("stopped");
    }
    view.stats.textContent = parts.join(" \u00b7 ");
    if (this.mode === "chat" && run.text) {
      this.history.push({ role: "assistant", content: run.text });
    }
    $("regenerate").disabled = false;
  }

  busy(on) {
    $("send").disabled = on;
    $("stop").disabled = !on;
    $("regenerate").disabled = on;
  }
}
