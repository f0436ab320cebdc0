"""A clock the scheduler state reads (`clock=`), moved by hand: `clock.t += 1.5`."""


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t
