"""A trace sink that keeps the events in memory, for tests to read."""


class ListSink:
    def __init__(self) -> None:
        self.events: list[dict] = []

    def emit(self, event: dict) -> None:
        self.events.append(event)
