"""Stop conditions and incremental text: EOS, stop strings, max_tokens, context length.

Tokens are committed one at a time so a stop inside an accepted draft cuts the output exactly
where plain decoding would have stopped. Text that might still become a stop string is held
back from the stream, so streamed text always equals the final text.
"""

from __future__ import annotations

from specdecode.params import SamplingParams
from specdecode.sequence import SequenceState
from specdecode.tokenizer import Tokenizer


class StopChecker:
    def __init__(self, tokenizer: Tokenizer, params: SamplingParams) -> None:
        self.params = params
        self.eos = frozenset() if params.ignore_eos else tokenizer.eos_token_ids
        self.decoder = tokenizer.stream_decoder()
        self.text = ""
        self._streamed = 0
        self.finish_reason = ""
        self._max_stop = max((len(s) for s in params.stop), default=0)

    @property
    def finished(self) -> bool:
        return bool(self.finish_reason)

    def push(self, seq: SequenceState, tokens: list[int]) -> list[int]:
        """Commit ``tokens`` to ``seq`` up to the first stop; return the ones committed."""
        committed = []
        for token in tokens:
            seq.token_ids.append(token)
            committed.append(token)
            if token in self.eos:
                self._add_text(self.decoder.flush())
                self.finish_reason = "stop"
            else:
                self._add_text(self.decoder.push([token]))
            if not self.finished and seq.num_generated >= self.params.max_tokens:
                self._add_text(self.decoder.flush())
                self.finish_reason = self.finish_reason or "length"
            if self.finished:
                break
        return committed

    def _add_text(self, piece: str) -> None:
        if not piece:
            return
        begin = max(0, len(self.text) - self._max_stop + 1)
        self.text += piece
        self._cut_at_stop_string(begin)

    def _cut_at_stop_string(self, begin: int) -> None:
        hits = [i for s in self.params.stop if (i := self.text.find(s, begin)) >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.finish_reason = "stop"

    def mark_length(self) -> None:
        """The context is full: finish as if max_tokens were reached."""
        if not self.finished:
            self._add_text(self.decoder.flush())
            self.finish_reason = self.finish_reason or "length"

    def take_text(self, final: bool = False) -> str:
        """Text that is final now: everything unless a stop string could still complete."""
        end = len(self.text)
        if not final and not self.finished:
            end -= self._held_back()
        piece = self.text[self._streamed : end]
        self._streamed = max(self._streamed, end)
        return piece

    def _held_back(self) -> int:
        """Length of the longest text suffix that is a proper prefix of some stop string."""
        best = 0
        for s in self.params.stop:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best
