// The page's one way to the server (docs/PROTOCOL.md §9.9): relative URLs only, so every request, and the
// API key with it, goes to the origin the page came from and nowhere else.

const KEY_ITEM = "skippy-zmq.api-key";

/** The API key typed into this tab ("" when none): sessionStorage only, gone when the tab closes. */
export function apiKey() {
  return sessionStorage.getItem(KEY_ITEM) || "";
}

/** Keep `key` for this tab ("" forgets it). */
export function setApiKey(key) {
  if (key) {
    sessionStorage.setItem(KEY_ITEM, key);
  } else {
    sessionStorage.removeItem(KEY_ITEM);
  }
}

/** A 401: the server needs a key, or another one. */
export class KeyNeeded extends Error {}

const keyListeners = [];

/** Call `listener(message)` whenever a request is refused for want of the right key. */
export function onKeyNeeded(listener) {
  keyListeners.push(listener);
}

/**
 * fetch() of a path relative to the page, with the API key when one was given; KeyNeeded on a 401.
 * `path` must be relative ("stages", "v1/models"): an absolute URL would carry the key elsewhere.
 */
export async function request(path, options = {}) {
  if (/^[a-z][a-z0-9+.-]*:|^\/\/|^\//i.test(path)) {
    throw new Error(`relative paths only, not ${path}`);
  }
  const headers = new Headers(options.headers || {});
  const key = apiKey();
  if (key) {
    headers.set("Authorization", `Bearer ${key}`);
  }
  const response = await fetch(path, { ...options, headers, credentials: "same-origin", cache: "no-store",
                                       redirect: "error", referrerPolicy: "no-referrer" });
  if (response.status === 401) {
    const message = key ? "the server refused this API key" : "this server needs its API key";
    keyListeners.forEach((listener) => listener(message));
    throw new KeyNeeded(message);
  }
  return response;
}

/** The message of an error answer ({"error": {"message"}} or {"message"}), else its status line. */
export async function errorText(response) {
  try {
    const body = await response.json();
    const error = body.error || body;
    if (error && typeof error.message === "string") {
      return `${response.status}: ${error.message}`;
    }
  } catch (_ignored) {
    // not JSON: the status line says enough
  }
  return `${response.status} ${response.statusText}`;
}

/**
 * The JSON objects of a server-sent event stream, as they arrive; `[DONE]` ends it. A body that ends
 * early ends the iteration; the caller's AbortSignal ends the fetch and so the stream.
 */
export async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) {
        return;
      }
      buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
      let end = buffer.indexOf("\n\n");
      while (end >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = block.split("\n").filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).trimStart()).join("\n");
        if (data === "[DONE]") {
          return;
        }
        if (data) {
          yield JSON.parse(data);
        }
        end = buffer.indexOf("\n\n");
      }
    }
  } finally {
    reader.releaseLock();
  }
}
