// tokenmill request explorer: token chips. A long prompt shows its head and tail with a count of the tokens between
// (one button shows them all), so a 1,000-token prompt does not push the lifecycle out of sight.
"use strict";

const PROMPT_COLLAPSE_ABOVE = 200;  // prompts longer than this are shown collapsed
const PROMPT_HEAD = 80, PROMPT_TAIL = 40;  // chips shown at each end of a collapsed prompt

function visible(text) { return text.replace(/ /g, "·").replace(/\n/g, "↵").replace(/\t/g, "⇥") || "∅"; }

function chip(text, id, cls, index) {
  const el = document.createElement("span");
  el.className = `chip ${cls || ""}`;
  el.title = `token ${id}: ${JSON.stringify(text)}`;
  if (index != null) el.dataset.index = index;
  const t = document.createElement("span"); t.textContent = visible(text);
  const n = document.createElement("span"); n.className = "id"; n.textContent = `#${id}`;
  el.append(t, n);
  return el;
}

// the prompt's chips into `box`: all of them, or head … "N more tokens" … tail; cached tokens marked
const promptView = { tokens: [], texts: [], cached: 0, expanded: false };

function showPrompt(box, tokens, texts) {
  Object.assign(promptView, { tokens, texts, cached: 0, expanded: tokens.length <= PROMPT_COLLAPSE_ABOVE });
  drawPrompt(box);
}

function drawPrompt(box) {
  const { tokens, texts, expanded } = promptView;
  const frag = document.createDocumentFragment();
  const add = (i) => frag.append(chip(texts[i], tokens[i], "", i));
  if (expanded) {
    tokens.forEach((_, i) => add(i));
  } else {
    for (let i = 0; i < PROMPT_HEAD; i++) add(i);
    const hidden = tokens.length - PROMPT_HEAD - PROMPT_TAIL;
    const more = document.createElement("button");
    more.type = "button";
    more.className = "more";
    more.dataset.testid = "prompt-more";
    more.textContent = `… ${hidden.toLocaleString()} more tokens (show all)`;
    more.onclick = () => { promptView.expanded = true; drawPrompt(box); };
    frag.append(more);
    for (let i = tokens.length - PROMPT_TAIL; i < tokens.length; i++) add(i);
  }
  box.replaceChildren(frag);
  markCachedChips(box, promptView.cached);
}

// the first `cachedTokens` prompt tokens came from the prefix cache
function markCachedChips(box, cachedTokens) {
  promptView.cached = cachedTokens;
  for (const el of box.querySelectorAll(".chip[data-index]")) {
    el.classList.toggle("cached", Number(el.dataset.index) < cachedTokens);
  }
}
