"""The wire codec, shared by the server and the clients: tensors <-> msgpack maps, bounded unpacking.

A tensor on the wire is the msgpack map ``{"dtype": "bfloat16" | "float16" | "float32", "shape": [...],
"data": <bin>}``, C order, little-endian, never pickle. In JSON bodies (control routes, curl) ``data`` is the
same bytes in base64. A conv's x and y may instead be ``{"dtype", "shape", "shm": {"key", "offset"}}``: the bytes
lie in a shared-memory segment of the client (:mod:`.shm`).

Encoding hands msgpack a ``memoryview`` of the tensor's own memory (msgpack copies it once into its output
buffer). Decoding wraps the ``bytes`` msgpack produced with ``torch.frombuffer`` / ``numpy.frombuffer``: no
further copy. Decoded tensors are therefore read-only views of the message; copy them before writing into them.

A tensor map is validated in this order: the dtype name (422 ``dtype_unsupported``), then the shape against
what the caller expects (422 ``shape_mismatch``, or 413 ``payload_too_large`` past the token limit), then the
length of ``data`` (400 ``bad_request``).

This module imports neither torch nor numpy at import time: the client works with numpy alone, and with torch
when the caller hands it torch tensors.
"""

from __future__ import annotations

import base64
import math
import re
import sys
import warnings
from typing import Any, Callable, Iterable, Optional

import msgpack

from convserve.clients.protocol.errors import BadRequest, DtypeUnsupported, PayloadTooLarge, ShapeMismatch

MEDIA_TYPE = "application/vnd.msgpack"
#: Request content types read as msgpack (the first is the one this service answers with).
MSGPACK_TYPES = ("application/vnd.msgpack", "application/msgpack", "application/x-msgpack")
JSON_TYPE = "application/json"

#: Item size of each dtype accepted on the wire.
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
DTYPE_NAMES = tuple(ITEMSIZE)

#: Structural bounds for decoded messages, besides the byte bound the caller passes.
MAX_DIMS = 8
_MAX_ARRAY_LEN = 4096     # shapes, layer lists, the session ids of a batch
_MAX_MAP_LEN = 32         # response maps (a request's maps are bounded by its object budget)

if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for is little-endian
    raise ImportError("convserve's wire codec assumes a little-endian host")

# torch warns once that a tensor made from immutable ``bytes`` is not writable: that is the zero-copy decode
# working as designed (the tensor is read-only by contract, see the module docstring).
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)


# ----------------------------------------------------------------------------------------------- msgpack


def _scalar(o):
    """msgpack's ``default``: a numpy or torch scalar (``np.int64(3)``, ``np.bool_(True)``, a 0-d tensor) as the
    Python number it holds, so a layer, position or flag may come straight from an array; anything else stays a
    TypeError."""
    if getattr(o, "ndim", None) == 0 and type(o).__module__.split(".")[0] in ("numpy", "torch"):
        v = o.item()
        if isinstance(v, (bool, int, float)):
            return v
    raise TypeError(f"cannot encode {type(o).__name__} in a msgpack message")


_packer_kwargs = dict(use_bin_type=True, datetime=False, default=_scalar)


def packb(obj: Any) -> bytes:
    """Serialize one message (maps, lists, str, int, float, bool, None, bytes/memoryview as bin; numpy and torch
    scalars as the number they hold)."""
    return msgpack.packb(obj, **_packer_kwargs)


def new_packer() -> msgpack.Packer:
    """A reusable packer (cheaper than :func:`packb` in a loop). Not thread-safe."""
    return msgpack.Packer(**_packer_kwargs)


def packb_split(obj: dict, key: str) -> tuple[bytes, memoryview]:
    """``packb(obj)`` as ``(head, data)`` with ``head + data`` equal to it, where ``obj[key]`` is a tensor map
    (:func:`encode_tensor`) and ``data`` its bytes, not copied: a large answer is sent from the tensor's memory.
    ``obj`` must hold ``key`` last, and the tensor map its ``data`` last (as :func:`encode_tensor` builds it)."""
    tmap = obj[key]
    data = tmap["data"]
    n = len(data) if not isinstance(data, memoryview) else data.nbytes
    head = packb({**obj, key: {**tmap, "data": b""}})
    assert head.endswith(b"\xc4\x00"), "the tensor's data must be packed last"
    bin_head = (b"\xc4" + n.to_bytes(1, "big") if n < 1 << 8 else b"\xc5" + n.to_bytes(2, "big") if n < 1 << 16
                else b"\xc6" + n.to_bytes(4, "big"))
    return head[:-2] + bin_head, memoryview(data).cast("B") if n else memoryview(b"")


#: Objects (array and map entries, and the containers themselves) one message may hold by default: a batch of
#: 4096 sessions with tokens and flags needs about 12,300.
MAX_OBJECTS = 65536
#: objects a batch body takes besides its sessions' (the map, x's map and shape, the other fields), at most; and per
#: session (its id, token count, speculative flag and position)
BATCH_FIXED_OBJECTS, BATCH_SESSION_OBJECTS = 64, 4


class TooManyObjects(PayloadTooLarge):
    """A message holds more objects than its budget (raised from inside the decoder, so decoding stops there)."""


class DuplicateKey(BadRequest):
    """A map (a JSON object, a msgpack map) holds one key twice: raised from inside the decoder, which would
    keep the last value."""


def unique_keys(pairs: list) -> dict:
    """The ``object_pairs_hook`` of every body the server decodes (JSON and msgpack): the map as a dict, or
    :class:`DuplicateKey` naming the key given twice (``{"session": "a", "session": "b"}`` is a mistake, never
    the last one winning)."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise DuplicateKey(f"the key {dup!r:.60} is given more than once in one map; give each key once")
    return obj


class ObjectBudget:
    """Counts a message's objects as msgpack builds its arrays and maps, and stops the decode past ``limit``: a
    body of millions of tiny arrays, each within the per-array bounds, is refused after ``limit`` objects
    instead of being decoded in full (time and memory). ``count`` is reset per message."""

    __slots__ = ("limit", "count")

    def __init__(self, limit: int):
        self.limit, self.count = limit, 0

    def _add(self, n: int) -> None:
        self.count += n + 1
        if self.count > self.limit:
            raise TooManyObjects(f"the message holds more than {self.limit} objects (arrays, maps and their "
                                 f"entries); a conv body needs a few dozen, a batch {BATCH_SESSION_OBJECTS} more per "
                                 "session: send the documented fields only, or raise --max-body-objects")

    def list_hook(self, v):
        self._add(len(v))
        return v

    def pairs_hook(self, pairs):
        self._add(len(pairs))
        return unique_keys(pairs)


def _bounds(max_bytes: int, budget: Optional[ObjectBudget] = None) -> dict:
    # one array or map holds at most as many entries as the message may hold objects (the budget, a setting of
    # the server): a batch of any max_batch_size within it decodes, no container is built past it, and a map of
    # unknown fields decodes to the 400 that names them. Strings, like bins, are bounded by the message's bytes:
    # the fields that hold one check their own lengths (a session id's rule, a tensor's base64 data)
    cap = None if budget is None else max(_MAX_ARRAY_LEN, budget.limit)
    kw = dict(raw=False, strict_map_key=True, use_list=True, max_bin_len=max_bytes, max_str_len=max_bytes,
              max_array_len=_MAX_ARRAY_LEN if cap is None else cap, max_map_len=_MAX_MAP_LEN if cap is None else cap,
              max_ext_len=0)
    if budget is not None:
        kw.update(list_hook=budget.list_hook, object_pairs_hook=budget.pairs_hook)
    return kw


def unpackb(data: bytes, max_bytes: int, max_objects: Optional[int] = None) -> Any:
    """Decode exactly one message of at most ``max_bytes`` (and ``max_objects`` objects, when given); raise
    :class:`BadRequest` if it is malformed, :class:`PayloadTooLarge` if it is too large."""
    if len(data) > max_bytes:
        raise PayloadTooLarge(f"the body has {len(data)} bytes, above the limit of {max_bytes}; "
                              "send fewer tokens per request (split a prefill into chunks)")
    try:
        return msgpack.unpackb(data, **_bounds(max_bytes, ObjectBudget(max_objects) if max_objects else None))
    except (TooManyObjects, DuplicateKey):
        raise
    except msgpack.ExtraData as e:
        if data[:1] in (b"{", b"["):
            raise BadRequest("the body is not msgpack: it looks like JSON; send it with Content-Type: "
                             "application/json, or encode it as one msgpack map") from None
        if not isinstance(e.unpacked, dict):
            raise BadRequest(f"the body is not one msgpack map (it starts with a {type(e.unpacked).__name__} "
                             f"and {len(e.extra)} more bytes follow); send exactly one msgpack map encoded "
                             "with bin types for bytes") from None
        raise BadRequest("the body holds more than one msgpack object; send exactly one map "
                         "(use /v1/conv/stream for many)") from None
    except (ValueError, msgpack.UnpackException, TypeError) as e:
        raise bound_error(e, "the body") or BadRequest(
            f"the body is not valid msgpack ({type(e).__name__}: {why_not_msgpack(e)}); send one "
            "msgpack map encoded with bin types for bytes") from None


def why_not_msgpack(e: Exception) -> str:
    """What msgpack's error says, or, for the two it raises without a message, what they mean."""
    if str(e):
        return str(e)
    if isinstance(e, msgpack.exceptions.StackError):
        return "nested too deeply"
    return "not a msgpack value" if isinstance(e, msgpack.exceptions.FormatError) else "malformed"


def bound_error(e: Exception, what: str) -> Optional[PayloadTooLarge]:
    """The :class:`PayloadTooLarge` for a decoder error that is one of the size bounds of :func:`_bounds` (an array,
    map or string longer than allowed; the message itself is valid msgpack), else None."""
    text = str(e)
    for bound, (kind, unit, advice) in _BOUNDS.items():
        if bound in text:
            m = re.fullmatch(r"(\d+) exceeds \w+\((\d+)\)", text)
            size = f"{kind} of {m[1]} {unit}, more than the {m[2]}" if m else f"{kind} larger than what"
            return PayloadTooLarge(f"{what} holds {size} this server takes; {advice}")
    return None


#: msgpack's bound, and what a message past it holds (a value of what, counted in what) and how to fix it
_BOUNDS = {"max_array_len": ("an array", "entries", "split the batch, or raise --max-body-objects"),
           "max_map_len": ("a map", "entries", "send the documented fields only"),
           "max_str_len": ("a string", "bytes", "send fewer tokens per request")}


def new_unpacker(max_bytes: int, budget: Optional[ObjectBudget] = None) -> msgpack.Unpacker:
    """A streaming unpacker that holds at most ``max_bytes`` of undecoded data (and, with ``budget``, stops a
    message past its object budget: the caller resets ``budget.count`` after each message).

    ``feed`` raises ``msgpack.BufferFull`` when one message would need more: the caller turns that into
    ``payload_too_large`` rather than silently losing the message (msgpack-python #503).
    """
    return msgpack.Unpacker(max_buffer_size=max_bytes, **_bounds(max_bytes, budget))


def json_text(data) -> str:
    """``data`` (bytes) as the text of a JSON body: UTF-8 without a byte order mark, as RFC 8259 has JSON
    exchanged between systems (``json.loads`` of bytes would also take UTF-16 and UTF-32, and a BOM); else 400."""
    try:
        text = str(data, "utf-8")         # (any buffer: a body's bytearray is not copied to bytes first)
    except UnicodeDecodeError as e:
        raise BadRequest(f"the JSON is not UTF-8 (byte {e.start}); send it encoded as UTF-8") from None
    if text.startswith("\ufeff"):
        raise BadRequest("the JSON starts with a byte order mark; send UTF-8 without one")
    return text


def loads_json(data: bytes, max_objects: Optional[int] = None) -> Any:
    import json

    # an upper bound of the objects, counted in C before anything is built: every value but the first follows
    # a comma, and every container opens with a bracket
    if max_objects is not None and data.count(b",") + data.count(b"[") + data.count(b"{") > max_objects:
        raise TooManyObjects(f"the JSON body holds more than {max_objects} values; send the documented fields "
                             "only, or raise --max-body-objects")
    try:
        return json.loads(json_text(data), object_pairs_hook=unique_keys)
    except ValueError as e:
        raise BadRequest(f"the body is not valid JSON ({e}); send a JSON object or use msgpack") from None
    except RecursionError:
        raise BadRequest("the JSON body is nested too deeply; send the flat object the route documents") from None


def dumps_json(obj: Any) -> bytes:
    import json

    return json.dumps(obj, separators=(",", ":"), default=_json_default).encode()


def _json_default(o):
    if isinstance(o, (bytes, bytearray, memoryview)):
        return base64.b64encode(o).decode("ascii")
    try:
        return _scalar(o)
    except TypeError:
        raise TypeError(f"cannot encode {type(o).__name__} as JSON") from None


# ----------------------------------------------------------------------------------------------- tensors


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "untyped_storage")


def dtype_name(x) -> str:
    """The wire name of a torch tensor's or numpy array's dtype, or :class:`DtypeUnsupported`."""
    if not _is_torch(x):
        return _numpy_name(x.dtype)
    name = _torch_names().get(x.dtype)
    if name is None:
        raise DtypeUnsupported(f"tensor dtype {x.dtype} is not supported on the wire; "
                               f"use one of {', '.join(DTYPE_NAMES)}")
    return name


def encode_tensor(x, shm=None) -> dict:
    """``{"dtype", "shape", "data"}`` for a torch tensor or a numpy array, ``data`` a view of its memory; or
    ``{"dtype", "shape", "shm"}`` when ``x`` lies in ``shm`` (a :class:`~convserve.clients.protocol.shm.ShmArena`).

    Torch tensors on a device are copied to the host first; non-contiguous ones are made contiguous.
    """
    if shm is not None:
        ref = shm.locate(x)
        if ref is not None:
            return {"dtype": dtype_name(x), "shape": list(x.shape), "shm": ref}
    if _is_torch(x):
        import torch

        name = dtype_name(x)
        t = x.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        shape = list(t.shape)
        if t.numel() == 0:
            return {"dtype": name, "shape": shape, "data": b""}
        return {"dtype": name, "shape": shape, "data": memoryview(t.view(torch.uint8).numpy()).cast("B")}
    import numpy as np

    a = np.asarray(x)
    name = _numpy_name(a.dtype)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    a = np.ascontiguousarray(a)
    return {"dtype": name, "shape": list(a.shape), "data": memoryview(a.reshape(-1).view(np.uint8))}


def encode_tensor_json(x) -> dict:
    """The JSON form: ``data`` in base64."""
    m = encode_tensor(x)
    m["data"] = base64.b64encode(m["data"]).decode("ascii")
    return m


def decode_tensor(obj: Any, *, check_shape: Optional[Callable[[tuple], None]] = None, backend: str = "torch",
                  name: str = "x", shm=None):
    """Validate a tensor map and wrap its data without copying.

    ``check_shape(shape)`` raises :class:`ShapeMismatch` (or :class:`PayloadTooLarge`) when the shape is wrong
    for the model. ``backend`` is ``"torch"`` or ``"numpy"``. A map with ``shm`` instead of ``data`` is a view
    of shared memory that ``shm.view(ref, dtype, shape, backend, name)`` returns (None: refused, 400).
    """
    if not isinstance(obj, dict):
        if obj is None:
            raise BadRequest(f"'{name}' is missing: send it as a tensor map {{dtype, shape, data}}")
        raise BadRequest(f"'{name}' must be a tensor map {{dtype, shape, data}}, got {type(obj).__name__}")
    dtype = obj.get("dtype")
    if not isinstance(dtype, str):
        raise BadRequest(f"'{name}.dtype' is missing or not a string; use one of {', '.join(DTYPE_NAMES)}")
    itemsize = ITEMSIZE.get(dtype)
    if itemsize is None:
        raise DtypeUnsupported(f"'{name}.dtype' {dtype!r:.40} is not supported; use one of {', '.join(DTYPE_NAMES)}")
    shape = obj.get("shape")
    if (not isinstance(shape, (list, tuple)) or len(shape) > MAX_DIMS
            or not all(type(s) is int and s >= 0 for s in shape)):
        raise BadRequest(f"'{name}.shape' must be a list of at most {MAX_DIMS} non-negative integers, "
                         f"got {shape!r:.80}")
    shape = tuple(shape)
    if check_shape is not None:
        check_shape(shape)
    if len(obj) != 3 or "data" not in obj:
        extra = [k for k in obj if k not in ("dtype", "shape", "data", "shm")]
        if extra or "data" in obj and "shm" in obj:
            raise BadRequest(f"'{name}' has fields {sorted(map(str, obj))}; a tensor map is {{dtype, shape, data}} "
                             "or {dtype, shape, shm}")
        if "shm" in obj:
            if shm is None:
                raise BadRequest(f"'{name}.shm': a tensor in shared memory is not taken here (the server's "
                                 "client_shm setting is off: start it with --client-shm on this host; or this field "
                                 "is not a conv's x); send 'data'")
            return shm.view(obj["shm"], dtype, shape, backend, name)
    data = obj.get("data")
    b64 = isinstance(data, str)
    if b64:  # JSON body: base64 (a string in msgpack is read the same way)
        try:
            data = base64.b64decode(data, validate=True)
        except ValueError:
            raise BadRequest(f"'{name}.data' is a string but not valid base64; in msgpack send bin, "
                             "in JSON send base64") from None
    elif not isinstance(data, (bytes, bytearray, memoryview)):
        raise BadRequest(f"'{name}.data' must be bin (msgpack) or base64 (JSON), got {type(data).__name__}")
    n = math.prod(shape)
    if len(data) != n * itemsize:
        got = f"is a string, read as base64, of {len(data)} bytes" if b64 else f"has {len(data)} bytes"
        raise BadRequest(f"'{name}.data' {got} but shape {list(shape)} of {dtype} needs {n * itemsize}; send the "
                         "tensor C-contiguous, little-endian, without padding (in msgpack as bin)")
    if backend == "torch":
        import torch

        tdt = getattr(torch, dtype)
        if n == 0:
            return torch.empty(shape, dtype=tdt)
        return torch.frombuffer(data, dtype=tdt).view(shape)
    import numpy as np

    return np.frombuffer(data, dtype=numpy_dtype(dtype)).reshape(shape)


_TORCH_NAMES: dict = {}


def _torch_names() -> dict:
    if not _TORCH_NAMES:
        import torch

        _TORCH_NAMES.update({torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"})
    return _TORCH_NAMES


def _numpy_name(dt) -> str:
    if dt.kind == "f" and dt.itemsize == 4:
        return "float32"
    if dt.kind == "f" and dt.itemsize == 2:
        return "float16"
    if dt.name == "bfloat16":  # ml_dtypes.bfloat16
        return "bfloat16"
    cast = " (a float64 array, as np.random.randn or a list of floats makes: cast it, .astype(np.float32))" \
        if dt.kind == "f" and dt.itemsize == 8 else ""
    raise DtypeUnsupported(f"array dtype {dt} is not supported on the wire; use one of {', '.join(DTYPE_NAMES)} "
                           f"(bfloat16 from numpy needs the ml_dtypes package){cast}")


def numpy_dtype(name: str):
    """The numpy dtype of a wire dtype name (bfloat16 through ml_dtypes)."""
    import numpy as np

    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise DtypeUnsupported("the server sent bfloat16, which numpy cannot hold without the ml_dtypes "
                                   "package: install ml_dtypes, or pass torch tensors, or send float32") from None
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def shape_checker(expected_tail: Iterable[int], *, min_first: int = 0, max_first: Optional[int] = None,
                  what: str = "x", first_name: str = "T") -> Callable[[tuple], None]:
    """A ``check_shape`` for ``(first, *expected_tail)`` with ``min_first <= first <= max_first``.

    Going past ``max_first`` is ``payload_too_large`` (too many tokens); everything else ``shape_mismatch``.
    """
    tail = tuple(expected_tail)
    want = f"({first_name}, {', '.join(str(s) for s in tail)})"

    def check(shape: tuple) -> None:
        if len(shape) != 1 + len(tail) or shape[1:] != tail:
            raise ShapeMismatch(f"'{what}' has shape {list(shape)}; the model needs {want}")
        if shape[0] < min_first:
            raise ShapeMismatch(f"'{what}' has {first_name}={shape[0]}; send at least {min_first}")
        if max_first is not None and shape[0] > max_first:
            raise PayloadTooLarge(f"'{what}' has {first_name}={shape[0]} tokens, above the limit of {max_first} "
                                  f"per request; split it into chunks of at most {max_first}")

    return check


def exact_shape_checker(expected: Iterable[int], what: str) -> Callable[[tuple], None]:
    exp = tuple(expected)

    def check(shape: tuple) -> None:
        if shape != exp:
            raise ShapeMismatch(f"'{what}' has shape {list(shape)}; the model needs {list(exp)}")

    return check
