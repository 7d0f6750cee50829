"""The conv-state pool: one tensor of every session's conv state, with slot allocation (see :mod:`.pool`)."""

from .pool import (NULL_SLOT, STATE_DTYPES, ConvStatePool, PoolDtypeError, PoolError, PoolExhausted,
                   PoolShapeError, auto_slots, pool_bytes, slots_for_bytes)

__all__ = ["NULL_SLOT", "STATE_DTYPES", "ConvStatePool", "PoolError", "PoolExhausted", "PoolShapeError",
           "PoolDtypeError", "auto_slots", "pool_bytes", "slots_for_bytes"]
