"""The Open Inference Protocol v2 (KServe / Triton HTTP) on the wire: reading an inference request (JSON, or a
JSON header followed by binary tensor data), writing its answer, and rendering errors as the protocol's
``{"error": "<message>"}``.

Nothing here touches the engine; :mod:`.oip` maps a parsed request onto sessions. Every function raises a
:class:`ServiceError` of the same code and status as ``/v1`` would for the same mistake, whose message names what
to send instead, and :func:`send_oip_error` renders it. A request is validated whole here, before anything runs.

The body of ``POST /v2/models/conv/infer``:

* without an ``Inference-Header-Content-Length`` header, one JSON object (whatever its Content-Type: KServe's
  client sends none, tritonclient none or ``application/octet-stream``);
* with it (the binary tensor data extension, tritonclient's default), that many bytes of JSON, then the raw data
  of each input whose ``parameters.binary_data_size`` is given, in the order of ``inputs``, nothing after.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from convserve.clients.protocol import wire
from convserve.clients.protocol.errors import BadRequest, DtypeUnsupported, PayloadTooLarge, ServiceError, UnknownLayer
from convserve.clients.protocol.ids import check_session_id
from convserve.service.http.asgi import ERROR_SCOPE_KEY, JSON_CT, header
from convserve.service.http.errors import retry_after

MODEL_NAME, MODEL_VERSION = "conv", "1"
INPUT, OUTPUT = "x", "y"
HEADER_LENGTH = b"inference-header-content-length"
OCTET_CT = b"application/octet-stream"

#: protocol datatype -> the wire/torch dtype name, for the datatypes x may have (y has x's)
DATATYPES = {"BF16": "bfloat16", "FP16": "float16", "FP32": "float32"}
OIP_DATATYPE = {v: k for k, v in DATATYPES.items()}

#: What each part of a request may hold; anything else is a 400 that names it and lists these.
REQUEST_FIELDS = ("id", "model_name", "parameters", "inputs", "outputs")
REQUEST_PARAMETERS = ("sequence_id", "sequence_start", "sequence_end", "layer", "speculative", "binary_data_output")
INPUT_FIELDS = ("name", "shape", "datatype", "parameters", "data")
INPUT_PARAMETERS = ("binary_data_size",)
OUTPUT_FIELDS = ("name", "parameters")
OUTPUT_PARAMETERS = ("binary_data",)

#: the largest sequence_id an integer may give (the protocol's uint64)
MAX_SEQUENCE_ID = (1 << 64) - 1


class NotFound(ServiceError):
    """No such model, version or /v2 route (the code of the framework's own 404)."""

    status, code = 404, "not_found"


@dataclass
class InferRequest:
    """A validated ``infer`` request: the session and what to do with it."""

    id: Optional[str]           # echoed in the answer
    session: str                # sequence_id as a session id (an integer as its decimal digits)
    start: bool
    end: bool
    layer: int
    speculative: bool
    x: torch.Tensor             # (T, dim) in the request's datatype
    datatype: str               # "BF16" | "FP16" | "FP32", of x and y
    binary_output: bool         # y as binary data after the JSON header


def check_keys(obj: dict, allowed, what: str, kind: str = "field") -> None:
    """:class:`BadRequest` naming the first key of ``obj`` not in ``allowed``: a misspelled field or parameter is
    never silently ignored."""
    for k in obj:
        if k not in allowed:
            raise BadRequest(f"unknown {kind} {k!r:.60} in {what}; the allowed {kind}s are {', '.join(allowed)}")


def _optional_map(obj: dict, key: str, what: str) -> dict:
    v = obj.get(key)
    if v is None:                                       # KServe's client writes absent maps as null
        return {}
    if type(v) is not dict:
        raise BadRequest(f"'{key}' of {what} must be an object, got {type(v).__name__}")
    return v


def _flag(params: dict, key: str) -> bool:
    v = params.get(key, False)
    if type(v) is not bool:
        raise BadRequest(f"parameter '{key}' must be true or false, got {v!r:.40}")
    return v


def session_of(sequence_id: Any) -> str:
    """The session id of a ``sequence_id``: a uint64 as its decimal digits (so ``42`` is the session ``"42"`` of
    the /v1 routes), a string as itself."""
    if type(sequence_id) is int:
        if not 1 <= sequence_id <= MAX_SEQUENCE_ID:
            raise BadRequest(f"parameter 'sequence_id' {sequence_id} is outside 1..2^64-1 (0 means no sequence, "
                             "and every request here belongs to one)")
        return str(sequence_id)
    if type(sequence_id) is str and sequence_id:
        return check_session_id(sequence_id, "parameter 'sequence_id'")
    raise BadRequest("parameter 'sequence_id' is missing, 0, empty or not an integer or a string; every request "
                     "belongs to a sequence (a session): send sequence_id, with sequence_start true on its first "
                     "request")


class InferParser:
    """Validates ``infer`` bodies against the served model and the settings' limits."""

    def __init__(self, info: dict, max_tokens_per_request: int, max_objects: int,
                 max_json_bytes: Optional[int] = None):
        self.max_json_bytes = max_json_bytes
        self.layers = list(info["layers"])
        self.layer_set = frozenset(self.layers)
        self.dim = int(info["dim"])
        self.x_check = wire.shape_checker((self.dim,), min_first=1, max_first=max_tokens_per_request)
        # JSON tensor data is one value per element: the body's object budget grows by the largest x (T rows of
        # dim values, and a bracket per row when nested), so only what no valid request holds is refused early
        self.max_objects = max_objects + max_tokens_per_request * (self.dim + 1)

    def parse(self, scope, body: bytes) -> InferRequest:
        enc = header(scope, b"content-encoding")
        if enc is not None and enc.strip().lower() not in (b"", b"identity"):
            raise BadRequest(f"Content-Encoding {enc.decode('latin-1')!r:.40} is not supported; send the body "
                             "uncompressed")
        head, binary = self._split(scope, body)
        req = self._json(head)
        if type(req) is not dict:
            raise BadRequest(f"an inference request must be a JSON object, got {type(req).__name__}")
        check_keys(req, REQUEST_FIELDS, "an inference request")
        name = req.get("model_name")
        if name is not None and name != MODEL_NAME:
            raise BadRequest(f"'model_name' {name!r:.60} does not match the route's model {MODEL_NAME!r}")
        rid = req.get("id")
        if rid is not None and type(rid) is not str:
            raise BadRequest(f"'id' must be a string, got {type(rid).__name__}")
        params = _optional_map(req, "parameters", "the request")
        check_keys(params, REQUEST_PARAMETERS, "the request's parameters", "parameter")
        session = session_of(params.get("sequence_id"))
        start, end = _flag(params, "sequence_start"), _flag(params, "sequence_end")
        spec, binary_output = _flag(params, "speculative"), _flag(params, "binary_data_output")
        layer = params.get("layer")
        if type(layer) is not int:
            raise BadRequest(f"parameter 'layer' is missing or not an integer; use a conv layer of the model: "
                             f"{self.layers}")
        if layer not in self.layer_set:
            raise UnknownLayer(f"layer {layer} has no conv; the model's conv layers are {self.layers}")
        x, datatype = self._input(req.get("inputs"), binary)
        return InferRequest(rid, session, start, end, layer, spec, x, datatype,
                            self._binary_output(req.get("outputs"), binary_output))

    # ------------------------------------------------------------------ parts

    @staticmethod
    def _split(scope, body: bytes) -> tuple[bytes, memoryview]:
        """``(JSON header, binary data)`` by the Inference-Header-Content-Length header."""
        h = header(scope, HEADER_LENGTH)
        if h is None:
            return body, memoryview(b"")
        try:
            n = int(h)
        except ValueError:
            n = -1
        if not 0 <= n <= len(body):
            raise BadRequest(f"Inference-Header-Content-Length {h.decode('latin-1')!r:.40} is not a length "
                             f"within the body's {len(body)} bytes")
        mv = memoryview(body)
        return mv[:n].tobytes(), mv[n:]

    def _json(self, head: bytes) -> Any:
        if self.max_json_bytes is not None and len(head) > self.max_json_bytes:
            raise PayloadTooLarge(f"the request's JSON has {len(head)} bytes, above the limit of "
                                  f"{self.max_json_bytes}; send x's data as binary (binary_data_size), or raise "
                                  "--max-json-body-bytes")
        # the same early bound as wire.loads_json, counted in C before anything is built
        if head.count(b",") + head.count(b"[") + head.count(b"{") > self.max_objects:
            raise wire.TooManyObjects(f"the JSON holds more than {self.max_objects} values; send x's data as "
                                     "binary (binary_data_size), or fewer tokens, or raise --max-body-objects")
        try:
            return json.loads(wire.json_text(head), object_pairs_hook=wire.unique_keys)  # a key twice: 400
        except RecursionError:
            raise BadRequest("the JSON is nested too deeply; send the object the protocol documents") from None
        except ValueError as e:
            raise BadRequest(f"the inference request is not valid JSON ({e}); with binary tensor data, "
                             "Inference-Header-Content-Length must be the length of the JSON part") from None

    def _input(self, inputs: Any, binary: memoryview) -> tuple[torch.Tensor, str]:
        if type(inputs) is not list or not inputs:
            raise BadRequest(f"'inputs' must be a list holding the one input {INPUT!r}")
        for i, inp in enumerate(inputs):
            if type(inp) is not dict:
                raise BadRequest(f"'inputs'[{i}] must be an object {{name, shape, datatype, data}}")
            if inp.get("name") != INPUT:
                raise BadRequest(f"unknown input {inp.get('name')!r:.60}; the model's one input is {INPUT!r}")
        if len(inputs) > 1:
            raise BadRequest(f"'inputs' holds {len(inputs)} inputs; the model has one, {INPUT!r}")
        inp = inputs[0]
        check_keys(inp, INPUT_FIELDS, f"input {INPUT!r}")
        params = _optional_map(inp, "parameters", f"input {INPUT!r}")
        check_keys(params, INPUT_PARAMETERS, f"input {INPUT!r}'s parameters", "parameter")
        datatype = inp.get("datatype")
        if type(datatype) is not str:
            raise BadRequest(f"input {INPUT!r}: 'datatype' is missing or not a string; use one of "
                             f"{', '.join(DATATYPES)}")
        dtype = DATATYPES.get(datatype)
        if dtype is None:
            raise DtypeUnsupported(f"input {INPUT!r}: datatype {datatype!r:.20} is not supported; use one of "
                                   f"{', '.join(DATATYPES)} (y comes back in the same)")
        shape = inp.get("shape")
        if type(shape) is not list or len(shape) > wire.MAX_DIMS or \
                not all(type(s) is int and s >= 0 for s in shape):
            raise BadRequest(f"input {INPUT!r}: 'shape' must be a list of non-negative integers, got {shape!r:.80}")
        self.x_check(tuple(shape))                        # (T, dim): 422 shape_mismatch, 413 past the token limit
        n = math.prod(shape)
        size = params.get("binary_data_size")
        data = inp.get("data")
        if size is None:
            if binary.nbytes:
                raise BadRequest(f"{binary.nbytes} bytes of binary data follow the JSON but no input has "
                                 "'binary_data_size'")
            return _from_json(data, shape, n, dtype), datatype
        itemsize = wire.ITEMSIZE[dtype]
        if type(size) is not int or size != n * itemsize:
            raise BadRequest(f"input {INPUT!r}: binary_data_size {size!r:.20} is not the {n * itemsize} bytes of "
                             f"shape {shape} in {datatype}; send the tensor C-contiguous, little-endian")
        if data is not None:
            raise BadRequest(f"input {INPUT!r} has both 'data' and binary_data_size; send one of them")
        if binary.nbytes != size:
            raise BadRequest(f"the body holds {binary.nbytes} bytes after the JSON, but input {INPUT!r} declares "
                             f"{size}: Inference-Header-Content-Length must be the JSON's length and nothing may "
                             "follow the tensor data")
        raw = binary if _aligned(binary, itemsize) else bytearray(binary)  # a JSON of odd length: copy, aligned
        return torch.frombuffer(raw, dtype=getattr(torch, dtype)).view(shape), datatype

    @staticmethod
    def _binary_output(outputs: Any, default: bool) -> bool:
        """Whether y goes as binary data: ``binary_data_output``, unless y's requested output says otherwise."""
        if outputs is None:
            return default
        if type(outputs) is not list:
            raise BadRequest("'outputs' must be a list of requested outputs {name, parameters}")
        if len(outputs) > 1:
            raise BadRequest(f"'outputs' names {len(outputs)} outputs; the model has one, {OUTPUT!r}: request it "
                             "once")
        binary = default
        for i, out in enumerate(outputs):
            if type(out) is not dict:
                raise BadRequest(f"'outputs'[{i}] must be an object {{name, parameters}}")
            check_keys(out, OUTPUT_FIELDS, f"'outputs'[{i}]")
            if out.get("name") != OUTPUT:
                raise BadRequest(f"unknown output {out.get('name')!r:.60}; the model's one output is {OUTPUT!r}")
            params = _optional_map(out, "parameters", f"output {OUTPUT!r}")
            check_keys(params, OUTPUT_PARAMETERS, f"output {OUTPUT!r}'s parameters", "parameter")
            if "binary_data" in params:
                binary = _flag(params, "binary_data")
        return binary


def _aligned(buf, itemsize: int) -> bool:
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data % itemsize == 0


def _has_bool(data: list) -> bool:
    """Whether a JSON true or false lies anywhere in ``data``: numpy reads a mix of numbers and booleans as numbers
    (true as 1), so its dtype does not tell. The types are gathered in C (``set(map(type, ...))``), one pass."""
    types = set(map(type, data))
    if bool in types:
        return True
    return list in types and any(_has_bool(v) for v in data if type(v) is list)


def _from_json(data: Any, shape: list, n: int, dtype: str) -> torch.Tensor:
    """x from JSON ``data``: numbers, flat in C order or nested as ``shape``."""
    if type(data) is not list:
        raise BadRequest(f"input {INPUT!r} has neither 'data' (a list of numbers) nor binary_data_size")
    try:
        arr = np.array(data)
    except (ValueError, OverflowError):
        arr = None
    if arr is None or arr.dtype.kind not in "iuf" or _has_bool(data):
        raise BadRequest(f"input {INPUT!r}: 'data' must hold numbers only (true and false are not numbers: send 1 "
                         "and 0), flat or nested as the shape")
    if arr.size != n or (arr.ndim != 1 and list(arr.shape) != list(shape)):
        raise BadRequest(f"input {INPUT!r}: 'data' has {arr.size} numbers in shape {list(arr.shape)}, but shape "
                         f"{shape} needs {n}, flat or nested as the shape")
    return torch.from_numpy(arr.astype(np.float64, copy=False).reshape(shape)).to(getattr(torch, dtype))


# ---------------------------------------------------------------------------------------------- answers


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def infer_answer(req: InferRequest, y: torch.Tensor) -> tuple[list, list]:
    """``(body chunks, headers)`` of the answer carrying ``y``: binary data after the JSON header when asked
    (``binary_data_output`` or the output's ``binary_data``), else the numbers in JSON."""
    y = y.contiguous()
    out: dict = {"name": OUTPUT, "datatype": req.datatype, "shape": list(y.shape)}
    ans: dict = {"model_name": MODEL_NAME, "model_version": MODEL_VERSION, "outputs": [out]}
    if req.id is not None:
        ans["id"] = req.id
    if not req.binary_output:
        out["data"] = y.float().reshape(-1).tolist()
        return [dumps(ans)], [(b"content-type", JSON_CT)]
    raw = memoryview(y.view(torch.uint8).numpy()).cast("B")
    out["parameters"] = {"binary_data_size": raw.nbytes}
    head = dumps(ans)
    return [head, raw], [(b"content-type", OCTET_CT), (HEADER_LENGTH, str(len(head)).encode())]


async def send_chunks(send, status: int, chunks: list, headers: list) -> None:
    total = sum(memoryview(c).nbytes for c in chunks)
    await send({"type": "http.response.start", "status": status,
                "headers": [*headers, (b"content-length", str(total).encode())]})
    for i, c in enumerate(chunks):
        await send({"type": "http.response.body", "body": bytes(c) if isinstance(c, memoryview) else c,
                    "more_body": i < len(chunks) - 1})


def oip_error_body(exc: ServiceError) -> tuple[bytes, list]:
    """``(body, headers)`` of the protocol's error answer: ``{"error": "<code>: <message>"}`` (the code of the
    same error on /v1 first, so a client can tell ``unknown_session`` from ``unknown_layer``), and Retry-After
    for a retryable one."""
    headers = [(b"content-type", JSON_CT)]
    ra = retry_after(exc)
    if ra is not None:
        headers.append((b"retry-after", str(max(1, math.ceil(ra))).encode()))
    return dumps({"error": f"{exc.code}: {exc.message}"}), headers


async def send_oip_error(scope, send, exc: ServiceError, extra_headers=()) -> None:
    """Answer a plain-ASGI request with ``exc`` in the protocol's form."""
    scope[ERROR_SCOPE_KEY] = exc.code
    body, headers = oip_error_body(exc)
    await send_chunks(send, exc.status, [body], [*headers, *extra_headers])
