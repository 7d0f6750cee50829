"""The wire protocol both sides import: the codec, the error classes and codes, the session-id rule, the dtype
names and the media types. It imports neither the server nor torch, so a client installs without them.
"""

from .errors import ALL_ERRORS, BY_CODE, ConvServeError, ServiceError
from .ids import MAX_SESSION_ID_LEN, check_session_id, is_session_id, new_session_id
from .wire import DTYPE_NAMES, ITEMSIZE, JSON_TYPE, MEDIA_TYPE, MSGPACK_TYPES

__all__ = ["ALL_ERRORS", "BY_CODE", "ConvServeError", "ServiceError", "MAX_SESSION_ID_LEN", "check_session_id",
           "is_session_id", "new_session_id", "DTYPE_NAMES", "ITEMSIZE", "JSON_TYPE", "MEDIA_TYPE", "MSGPACK_TYPES"]
