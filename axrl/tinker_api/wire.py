"""The three protobuf payloads of the Tinker API (`tinker.proto.tinker_public_pb2`, the descriptor
that ships in the SDK) and the datum layout AxRL trains on.

In: the `forward_backward` request body. Out: `ForwardBackwardOutput` and `SampleResponse`, the
results of `retrieve_future` that the SDK only accepts as protobuf. Everything else is JSON.

A Tinker datum is next-token shaped: `model_input` holds tokens x_0..x_{n-1} and
`loss_fn_inputs["target_tokens"]` the tokens each position predicts. AxRL packs token-in /
token-out sequences (`PackedBatch`: a token's logprob at its own row), so a datum must be the
usual shift — target_tokens[i] == model_input[i + 1] — and becomes the sequence x_0..x_{n-1}, y_{n-1}
whose row i + 1 carries the datum's position i.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from axrl.tinker_api.errors import RefusedRequest, UserError

#: loss_fn_inputs AxRL reads, with their wire dtype (others are refused: nothing would use them)
DATUM_KEYS = {"target_tokens": "int64", "weights": "float32", "advantages": "float32", "logprobs": "float32",
              "mask": "float32"}


def _pb() -> Any:
    from tinker.proto import tinker_public_pb2

    return tinker_public_pb2


@dataclass
class Datum:
    """One decoded datum: the packed sequence (n + 1 tokens) and its per-position inputs (n each)."""

    tokens: np.ndarray                      # int64 [n + 1]
    inputs: dict[str, np.ndarray] = field(default_factory=dict)   # name -> [n] (float32, target_tokens int64)

    @property
    def n(self) -> int:
        return int(self.tokens.size) - 1


@dataclass
class ForwardBackwardCall:
    """A decoded `forward_backward` (or `forward`) request."""

    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    forward_only: bool
    data: list[Datum]


def _tensor(name: str, msg: Any) -> np.ndarray:
    pb = _pb()
    dtypes = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
    if msg.dtype not in dtypes:
        raise UserError(f"loss_fn_inputs[{name!r}]: unsupported dtype {msg.dtype} (float32 or int64)")
    if msg.HasField("sparse_csr"):
        raise UserError(f"loss_fn_inputs[{name!r}]: sparse tensors are not supported by AxRL (send it dense)")
    arr = np.frombuffer(msg.dense, dtype=dtypes[msg.dtype])
    shape = list(msg.shape)
    if len(shape) > 1:
        raise UserError(f"loss_fn_inputs[{name!r}]: shape {shape}; AxRL takes one value per position (1-D)")
    return arr


def _datum(i: int, msg: Any) -> Datum:
    tokens: list[np.ndarray] = []
    for chunk in msg.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise UserError(f"data[{i}].model_input: only token chunks are supported (got {kind}: "
                            "images and audio are not)")
        tokens.append(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).astype(np.int64))
    x = np.concatenate(tokens) if tokens else np.zeros(0, np.int64)
    inputs = {}
    for name, t in msg.loss_fn_inputs.items():
        if name not in DATUM_KEYS:
            raise UserError(f"data[{i}].loss_fn_inputs[{name!r}]: unknown input (AxRL reads {sorted(DATUM_KEYS)})")
        a = _tensor(name, t)
        if a.size != x.size:
            raise UserError(f"data[{i}].loss_fn_inputs[{name!r}] has {a.size} values for {x.size} model_input "
                            "tokens: every input needs one value per position")
        if not np.isfinite(a).all():
            bad = int(np.nonzero(~np.isfinite(a))[0][0])
            raise UserError(f"data[{i}].loss_fn_inputs[{name!r}][{bad}] is {a[bad]}: every value must be finite "
                            "(a NaN or infinite input would poison the accumulated gradients)")
        inputs[name] = a.astype(np.int64 if DATUM_KEYS[name] == "int64" else np.float32)
    if x.size == 0:
        raise UserError(f"data[{i}].model_input is empty")
    if "target_tokens" not in inputs:
        raise UserError(f"data[{i}].loss_fn_inputs: target_tokens is required")
    y = inputs.pop("target_tokens")
    if not np.array_equal(y[:-1], x[1:]):
        bad = int(np.nonzero(y[:-1] != x[1:])[0][0])
        raise UserError(f"data[{i}]: target_tokens[{bad}] = {int(y[bad])} is not model_input[{bad + 1}] = "
                        f"{int(x[bad + 1])}: AxRL trains on token sequences, so target_tokens must be "
                        "model_input shifted by one (as tinker_cookbook builds datums)")
    return Datum(tokens=np.concatenate([x, y[-1:]]), inputs=inputs)


def decode_forward_backward(body: bytes) -> ForwardBackwardCall:
    """The `forward_backward` request body (protobuf) as a `ForwardBackwardCall`; UserError names
    what is wrong with it."""
    pb = _pb()
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as e:  # noqa: BLE001 - the protobuf runtime raises its own DecodeError
        raise UserError(f"forward_backward: the body is not a ForwardBackwardRequest protobuf: {e}") from None
    try:
        config: dict[str, float | str] = {k: float(v) for k, v in msg.loss_fn_config.items()}
        for k, v in msg.loss_fn_config_v2.items():
            config[k] = v.text if v.WhichOneof("value") == "text" else float(v.number)
        data = [_datum(i, d) for i, d in enumerate(msg.data)]
    except UserError as e:
        # the header parsed: the refusal carries the request's place in the model's seq_id order
        raise RefusedRequest(str(e), msg.model_id, int(msg.seq_id)) from None
    return ForwardBackwardCall(model_id=msg.model_id, seq_id=int(msg.seq_id), loss_fn=msg.loss_fn,
                              loss_fn_config=config, forward_only=bool(msg.forward_only), data=data)


def _batched(arrays: list[np.ndarray], dtype: Any) -> Any:
    pb = _pb()
    bt = pb.BatchedTensor()
    parts = [np.ascontiguousarray(a, dtype=dtype) for a in arrays]
    bt.data = b"".join(p.tobytes() for p in parts)
    bt.offsets = np.cumsum([0] + [p.nbytes for p in parts]).astype(np.int64).tobytes()
    bt.dtype = pb.DTYPE_FLOAT32 if np.dtype(dtype) == np.float32 else pb.DTYPE_INT64
    return bt


def encode_forward_backward_output(outputs: dict[str, list[np.ndarray]], metrics: dict[str, float],
                                   num_datums: int) -> bytes:
    """A `ForwardBackwardOutput`: per-datum float32 arrays (e.g. `logprobs`, `elementwise_loss`),
    one ArrayRecord for the batch, and the call's metrics (`name:reduction`)."""
    pb = _pb()
    out = pb.ForwardBackwardOutput()
    out.loss_fn_output_type = "ArrayRecord"
    rec = out.loss_fn_outputs.add()
    rec.type_tag = "ArrayRecord"
    rec.num_datums = num_datums
    for name, arrays in outputs.items():
        rec.fields[name].CopyFrom(_batched(arrays, np.float32))
    for k, v in metrics.items():
        out.metrics[k] = float(v)
    return out.SerializeToString()


@dataclass
class Sequence:
    """One sampled sequence as the SDK sees it."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: str        # "stop" | "length"


def encode_sample_response(sequences: list[Sequence], prompt_logprobs: np.ndarray | None) -> bytes:
    """A `SampleResponse` (tokens int32, logprobs float32; prompt logprobs NaN at position 0)."""
    pb = _pb()
    out = pb.SampleResponse()
    for s in sequences:
        seq = out.sequences.add()
        seq.stop_reason = pb.STOP_REASON_STOP if s.stop_reason == "stop" else pb.STOP_REASON_LENGTH
        seq.tokens = np.asarray(s.tokens, np.int32).tobytes()
        seq.logprobs = np.asarray(s.logprobs, np.float32).tobytes()
    if prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray(prompt_logprobs, np.float32).tobytes()
    return out.SerializeToString()
