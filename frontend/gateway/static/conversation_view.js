// The conversation on screen: one article per turn, with its copy button and, for answers, the stats line. The
// streaming answer's nodes are updated in place, so a long answer does not redraw the page at every token.

import { statsLine } from "./answer_stats.js";
import { $, copyButton, element } from "./dom.js";

/** Draws every turn afresh; returns the last turn's view (the answer about to stream, when sending). */
export function renderConversation(conversation) {
  $("conversation").replaceChildren(...conversation.turns.map(turnView));
  $("empty").hidden = conversation.turns.length > 0;
  return $("conversation").lastElementChild;
}

/** Redraws one turn's text, stats and error; keeps the view scrolled to the end if the reader was there. */
export function updateTurn(view, turn, streaming) {
  const following = window.innerHeight + window.scrollY >= document.body.scrollHeight - 40;
  view.querySelector(".content").textContent = turn.content;
  view.querySelector(".stats").textContent = statsLine(turn.figures);
  view.querySelector(".error").textContent = turn.error ?? "";
  view.classList.toggle("streaming", streaming);
  view.classList.toggle("failed", Boolean(turn.error));
  if (following) window.scrollTo(0, document.body.scrollHeight);
}

function turnView(turn) {
  const header = element(
    "header",
    {},
    element("span", { className: "role", textContent: turn.role === "user" ? "You" : "Assistant" }),
    copyButton(() => turn.content || turn.error || ""),
  );
  const view = element(
    "article",
    { className: `turn ${turn.role}` },
    header,
    element("div", { className: "content", textContent: turn.content }),
    element("div", { className: "error", textContent: turn.error ?? "" }),
    element("div", { className: "stats", textContent: statsLine(turn.figures) }),
  );
  view.classList.toggle("failed", Boolean(turn.error));
  return view;
}
