"""Chat in the browser: a run's final model, an adapter or any HF folder loaded into the inference engine
(the one `shardforge chat` and `serve` use), replies streamed token by token. One model at a time; the
engine is driven by one request at a time (a lock), as the terminal chat drives it."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

from shardforge.infer.engine import Engine
from shardforge.infer.offline import chat_ids
from shardforge.infer.sampling import SamplingParams
from shardforge.infer.session import inference_engine


class ChatSession:
    def __init__(self) -> None:
        self.engine: Engine | None = None
        self.name = ""
        self._stack = contextlib.ExitStack()
        self._lock = threading.Lock()
        self._turn = 0

    def load(self, source: Path, adapter: Path | None = None) -> str:
        """Load `source` (unloading what was loaded); returns a line saying what is loaded."""
        with self._lock:
            self._stack.close()
            self.engine = None
            self._stack = contextlib.ExitStack()
            loaded, engine = self._stack.enter_context(
                inference_engine(str(source), str(adapter) if adapter else None)
            )
            self.engine, self.name = engine, loaded.name
        return f"loaded {loaded.name} from {loaded.folder}"

    def reply(self, messages: list[dict], temperature: float, top_p: float, max_tokens: int) -> Iterator[str]:
        """Stream the assistant's reply to `messages` (role/content dicts): the text so far, growing."""
        if self.engine is None:
            raise RuntimeError("load a model first")
        # Unset parameters come from the model's generation_config.json, as in the terminal chat.
        params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=int(max_tokens)).check()
        with self._lock:
            self._turn += 1
            request = f"webui-{self._turn}"
            self.engine.add(request, chat_ids(self.engine.tokenizer, messages), params)
            text = ""
            try:
                while self.engine.has_work():
                    for update in self.engine.step():
                        text += update.text
                        yield text
            finally:
                if self.engine.has_work():  # the browser went away mid-reply
                    self.engine.abort(request)

    def close(self) -> None:
        with self._lock:
            self._stack.close()
            self.engine = None
