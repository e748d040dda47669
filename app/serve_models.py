"""The models `nanochat serve` answers for: the one it loads at start, and the ones the model picker lists (the
built-in model, recent ones, the models folder, ./models, the hub cache), each loaded when a request names it, as
Ollama's server loads models. One model is loaded at a time: a request for another waits for the requests in
flight to end (and holds back new ones meanwhile), then the engine process loads it; if that fails the previous
model stays and the request gets the one-line error. Conversations kept for the previous model are closed.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Served:
    id: str                         # its name in the API
    path: str                       # what the engine loads (a file, a folder, a hub id)
    aliases: tuple[str, ...] = ()   # other names a request may use for it


def names_match(given: str, names) -> bool:
    """Whether a request's model is one of `names`; Ollama adds a ":latest" tag to names without one."""
    return given in names or given.removesuffix(":latest") in names


def catalog_models(loaded: Served, entries) -> list[Served]:
    """The models the catalog's `entries` (ModelEntry) add to the loaded one: each named by its file or folder name
    (a hub repo by its id), the first of a name kept, none that is the loaded model."""
    taken = {loaded.id, *loaded.aliases}
    out = []
    for entry in entries:
        name = entry.name if entry.origin == "hub" and entry.kind == "hf" else Path(entry.path).name
        if name in taken or entry.path in taken:
            continue
        taken.add(name)
        out.append(Served(name, entry.path, (entry.path,)))
    return out


class Roster:
    """Which model is loaded, which others may be (`discover()`: the catalog's, looked up again when a list is asked
    for or a request names a model not seen yet), and the switch between them. `holds`: requests that use the
    loaded model now (from `use` until `release`)."""

    def __init__(self, loaded: Served, discover=None):
        self.first = self.loaded = loaded   # first: the one the server started with
        self.others: list[Served] = []
        self.holds = 0
        self._discover = discover
        self._idle = asyncio.Event()
        self._idle.set()
        self._switch: asyncio.Future | None = None

    @property
    def models(self) -> list[Served]:
        """Every model, the loaded one first."""
        return [self.loaded] + [m for m in [self.first, *self.others] if m != self.loaded]

    async def refresh(self) -> None:
        if self._discover is not None:
            found = await asyncio.to_thread(self._discover)
            self.others = catalog_models(self.first, found)

    async def find(self, name: str | None) -> Served | None:
        """The model a request names (None: the loaded one), or None when it names none of them."""
        if name is None:
            return self.loaded
        for attempt in range(2):
            served = next((m for m in self.models if names_match(name, (m.id, *m.aliases))), None)
            if served is not None or attempt or self._discover is None:
                return served
            await self.refresh()   # a model added since the last look
        return None

    async def use(self, served: Served, load) -> None:
        """Hold `served` loaded for a request: wait for a switch in progress, then switch to it if it is not the
        loaded model (`load(path)` loads it in the engine; what it raises is the request's error)."""
        while True:
            while self._switch is not None:
                await asyncio.shield(self._switch)
            if served == self.loaded:
                self.holds += 1
                self._idle.clear()
                return
            self._switch = asyncio.get_running_loop().create_future()
            try:
                while self.holds:
                    await self._idle.wait()
                await load(served.path)
                self.loaded = served
            finally:
                switch, self._switch = self._switch, None
                switch.set_result(None)

    def release(self) -> None:
        """A request that held the loaded model is over."""
        self.holds -= 1
        if self.holds == 0:
            self._idle.set()
