"""A completion's text as its tokens come: stop strings, and streamed pieces that never split a character
or hand out the start of a stop string that may still be completed."""

from __future__ import annotations

from typing import Any


class TextStream:
    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = (), keep_stop: bool = False) -> None:
        self.tokenizer, self.stop, self.keep_stop = tokenizer, stop, keep_stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.sent = 0  # characters handed out so far
        self.stopped: str | None = None  # the stop string that ended it
        self.floor = 0  # a stop string must end past this (the text made before min_tokens was reached)

    def update(self, output_ids: list[int], stops: bool = True) -> None:
        """The whole output so far (decoded anew: a token's text can depend on its neighbours). `stops`
        False: stop strings do not count yet (before min_tokens, as vLLM), nor later in the text made so
        far."""
        text = self.tokenizer.decode(output_ids, skip_special_tokens=True)
        if not stops:
            self.text, self.floor = text, len(text)
            return
        for stop in self.stop:
            at = text.find(stop, max(0, self.sent - len(stop), self.floor - len(stop) + 1))
            if at >= 0:
                self.stopped = stop
                text = text[: at + len(stop)] if self.keep_stop else text[:at]
                break
        self.text = text

    def delta(self, final: bool) -> str:
        """The text not handed out yet that is safe to hand out (all of it when `final`)."""
        end = len(self.text)
        if not final:
            end -= self.hold
            while end > self.sent and self.text[end - 1] == "\ufffd":  # a character still incomplete
                end -= 1
        if end <= self.sent:
            return ""
        piece, self.sent = self.text[self.sent : end], end
        return piece
