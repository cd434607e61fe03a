// The web page of `skippy-zmq serve` (docs/PROTOCOL.md §9.9): a chat view and a pipeline view, plain
// JavaScript modules served by the gateway itself; nothing is fetched from anywhere else.

import { apiKey, onKeyNeeded, setApiKey } from "./api.js";
import { Chat } from "./chat.js";
import { Pipeline } from "./pipeline.js";

const $ = (id) => document.getElementById(id);
const VIEWS = ["chat", "pipeline"];

function show(view) {
  const name = VIEWS.includes(view) ? view : "chat";
  for (const other of VIEWS) {
    $(`view-${other}`).hidden = other !== name;
    $(`tab-${other}`).setAttribute("aria-selected", String(other === name));
  }
  if (location.hash !== `#${name}`) {
    history.replaceState(null, "", `#${name}`);
  }
  return name;
}

function start() {
  new Chat();
  const pipeline = new Pipeline();
  const select = (view) => {
    if (show(view) === "pipeline") {
      pipeline.redraw();
    }
  };
  for (const tab of document.querySelectorAll(".tabs button")) {
    tab.addEventListener("click", () => select(tab.dataset.view));
  }
  window.addEventListener("hashchange", () => select(location.hash.slice(1)));
  select(location.hash.slice(1));

  const form = $("key-form");
  onKeyNeeded((message) => {
    form.hidden = false;
    $("key-error").textContent = apiKey() ? message : "";
    $("key").focus();
  });
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    setApiKey($("key").value.trim());
    $("key").value = "";
    $("key-error").textContent = "";
    form.hidden = true;
    pipeline.start();
  });
  pipeline.start();
}

start();
