"""One process on one device."""

from __future__ import annotations

from ember.strategies.strategy import Strategy


class SingleDeviceStrategy(Strategy):
    """One process, one device (a CPU or one GPU): the default when more are not asked for.

    Everything it does is the base ``Strategy``'s behaviour; parallel strategies change parts of it.
    """
