"""The served models: their names, the default, and each one's tokenizer (loaded when its scheduler is ready)."""

from __future__ import annotations

import grpc

from common.chat_template import ChatTemplate
from frontend.errors import RequestError
from frontend.scheduler_link import SchedulerLink
from gpu_runtime.ipc.messages import SchedulerReady
from gpu_runtime.tokenizer import Tokenizer


class ModelCatalog:
    def __init__(self, link: SchedulerLink, default_model: str, aliases: dict[str, str] | None = None):
        self._link = link
        self.default_model = default_model
        self.aliases = aliases or {}
        self.names = list(dict.fromkeys([default_model] + [s.address.model_name for s in link.schedulers]))
        self._tokenizers: dict[str, Tokenizer] = {}
        self._chat_templates: dict[str, ChatTemplate | None] = {}
        self._latest: dict[str, SchedulerReady] = {}

    def resolve(self, requested: str) -> str:
        """The served name a request means; NOT_FOUND names the field when there is none."""
        name = self.aliases.get(requested, requested) or self.default_model
        if name not in self.names:
            raise RequestError(
                grpc.StatusCode.NOT_FOUND, f"model: {requested!r} is not served here; served: {self.names}"
            )
        return name

    def tokenizer(self, ready: SchedulerReady) -> Tokenizer:
        # By directory: a rollout's new weights may come with their own tokenizer.
        tokenizer = self._tokenizers.get(ready.model_dir)
        if tokenizer is None:
            tokenizer = self._tokenizers[ready.model_dir] = Tokenizer(ready.model_dir)
        return tokenizer

    def chat_template(self, ready: SchedulerReady) -> ChatTemplate | None:
        if ready.model_dir not in self._chat_templates:
            self._chat_templates[ready.model_dir] = ChatTemplate.from_model_dir(ready.model_dir, ready.chat_template)
        return self._chat_templates[ready.model_dir]

    def describe(self, name: str) -> SchedulerReady | None:
        """The SchedulerReady of a scheduler of the model new requests go to (the newest weights), or None when
        none is up. While a rollout is between workers, the latest any worker of the model said."""
        ready = self._link.routed_schedulers(name, draw=0.0)
        if ready:
            self._latest[name] = ready[0].ready
            return ready[0].ready
        return self._latest.get(name) if self._link.expects_capacity(name) else None
