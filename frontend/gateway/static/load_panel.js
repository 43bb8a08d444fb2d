// The server load panel: GET /v1/load (the frontend's load reports) every REFRESH_MS while the tab is visible,
// one card per scheduler: running and waiting requests, KV cache use, and the first-token time a request sent now
// is projected to see. The call carries the API key: with tenants, only an admin key may read the load.

import { apiError } from "./chat_stream.js";
import { $, element } from "./dom.js";

const REFRESH_MS = 1500;
// While this page's own answer streams: its figures move every step and the user is watching them (the scheduler
// reports every 0.2 s).
const STREAMING_REFRESH_MS = 400;
// A report older than this means the scheduler stopped reporting (the daemon's liveness timeout is 2 s).
const STALE_S = 5;

/** Starts the panel; returns { refresh, setStreaming }: refresh reads the load now, setStreaming(true) makes the
 * panel refresh quicker until setStreaming(false). */
export function startLoadPanel(authHeaders) {
  let timer = null;
  let streaming = false;
  let latest = 0; // a key change starts a refresh while one may be under way: only the latest one counts
  const refresh = async () => {
    const mine = ++latest;
    clearTimeout(timer);
    try {
      if (!document.hidden) {
        const [status, schedulers] = await readLoad(authHeaders());
        if (mine === latest) show(status, schedulers);
      }
    } finally {
      // After the answer, not on a fixed beat: a slow server never gets overlapping calls.
      if (mine === latest) timer = setTimeout(refresh, streaming ? STREAMING_REFRESH_MS : REFRESH_MS);
    }
  };
  const setStreaming = (on) => {
    streaming = on;
    refresh();
  };
  document.addEventListener("visibilitychange", () => {
    if (!document.hidden) refresh();
  });
  refresh();
  return { refresh, setStreaming };
}

/** [the status line, the schedulers' reports] */
async function readLoad(headers) {
  let reply;
  try {
    reply = await fetch("/v1/load", { headers, cache: "no-store" });
    if (reply.status === 401) return ["load needs an API key: enter an admin tenant's key", []];
    if (reply.status === 403) return ["load needs an admin key: this key's tenant is not an admin", []];
    if (!reply.ok) return [`cannot read the load: ${(await apiError(reply)).describe()}`, []];
    const load = await reply.json();
    return [`${load.in_flight} in flight${load.draining ? " · draining" : ""} · updated ${clock()}`, load.schedulers];
  } catch {
    return ["the gateway does not answer", []];
  }
}

function show(text, schedulers) {
  $("load-status").textContent = text;
  $("load-schedulers").replaceChildren(...schedulers.map(schedulerCard));
}

/** One scheduler: its model and GPU group, then its four figures. */
function schedulerCard(s) {
  const up = s.ready && s.report_age_seconds < STALE_S;
  const kv = element("meter", { min: 0, max: 1, value: s.kv_cache_usage });
  const card = element(
    "div",
    {
      className: `scheduler ${up ? "up" : "down"}`,
      title: `pid ${s.pid}, report ${s.report_age_seconds.toFixed(1)} s old`,
    },
    element("div", { className: "name", textContent: `${s.model} · group ${s.group}${up ? "" : " · down"}` }),
    figure("running", String(s.num_running), "running"),
    figure("waiting", String(s.num_waiting), "waiting"),
    figure("kv", percent(s.kv_cache_usage), "KV cache", kv),
    figure("ttft", seconds(s.projected_ttft_seconds), "TTFT now"),
  );
  card.dataset.model = s.model;
  card.dataset.group = s.group;
  return card;
}

function figure(name, value, label, ...extra) {
  return element(
    "div",
    { className: "figure" },
    element("span", { className: `value ${name}`, textContent: value }),
    ...extra,
    element("span", { className: "label", textContent: label }),
  );
}

function percent(share) {
  const value = 100 * share;
  return `${value > 0 && value < 10 ? value.toFixed(1) : value.toFixed(0)}%`;
}

function seconds(value) {
  return value < 1 ? `${(1000 * value).toFixed(0)} ms` : `${value.toFixed(1)} s`;
}

function clock() {
  return new Date().toLocaleTimeString([], { hour12: false });
}
