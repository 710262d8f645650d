"""The prompt set and the forced-remote override of the disagg-equals-agg tests (torch
and vLLM check the same 20 prompts, 8 of them sharing a long prefix)."""

from __future__ import annotations

MODEL = "SmolLM2-135M-Instruct"
FORCED = "--DecodeWorker.disaggregated_router={enable: true, decider: forced, remote: true}"
SHARED = ("The following is a detailed report on the history of European railways, covering "
          "the first steam locomotives, the expansion of national networks, electrification, "
          "and the arrival of high-speed lines in the late twentieth century. ") * 4
QUESTIONS = [
    "What is the capital of France?", "Name a primary colour.", "What is 7 plus 5?",
    "Write one word that rhymes with cat.", "Who painted the Mona Lisa?",
    "What is the boiling point of water in Celsius?", "Name a large ocean.",
    "Give a synonym for quick.", "What is the opposite of cold?",
    "How many legs does a spider have?", "What colour is the sky on a clear day?",
    "Name a fruit that is yellow.",
]
PROMPTS = QUESTIONS + [SHARED + q for q in QUESTIONS[:8]]  # 20 prompts, 8 share a prefix
