"""Train the qtool demo model: a small residual CNN on the UCI 8x8 digits.

This is a developer tool that (re)generates the demo artifacts next to this
file; it is NOT a runtime dependency of qtool.  It:

1. loads scikit-learn's bundled ``load_digits`` (1797 images, 8x8, pixel
   values 0..16 -- no download needed),
2. makes a stratified, seeded split: 70% training / 30% held-out,
3. trains a small CNN in PyTorch (CPU, fixed seeds, deterministic algorithms,
   single thread),
4. builds the ONNX graph *by hand* with ``onnx.helper`` from the trained
   weights (no ``torch.onnx.export``), so the op set is exactly controlled and
   BatchNormalization stays a separate, unfused node after every Conv,
5. checks the ONNX model with ``onnx.checker`` (full_check) and runs it with
   onnxruntime on the held-out split, asserting that its logits match the
   PyTorch eval-mode logits (max abs diff < 1e-4) and that float top-1
   accuracy is >= 95%,
6. writes:

   * ``digits_cnn.onnx``      -- the trained model (opset 13, ir_version 8)
   * ``digits_calib.npz``     -- calibration split, 256 samples drawn from the
     TRAINING split: ``input`` float32 [256,1,8,8], ``label`` int64 [256]
   * ``digits_heldout.npz``   -- held-out split, never used for training:
     ``input`` float32 [540,1,8,8], ``label`` int64 [540]

Preprocessing: input = pixel_value / 16.0 (float32, so inputs are in [0, 1]),
laid out NCHW as [N, 1, 8, 8].  No mean/std normalisation.

Model (input ``input`` [N,1,8,8] float32, N symbolic; output ``logits`` [N,10]):

    conv1 3x3 1->16 pad1 -> bn1 -> relu1                       [N,16,8,8]
    residual block:
        block_conv1 3x3 16->16 pad1 -> block_bn1 -> block_relu1
        block_conv2 3x3 16->16 pad1 -> block_bn2
        block_add (+ block input) -> block_relu2                [N,16,8,8]
    pool 2x2 stride 2 (MaxPool)                                  [N,16,4,4]
    conv2 3x3 16->32 pad1 -> bn2 -> relu2                        [N,32,4,4]
    gap (GlobalAveragePool) -> flatten                           [N,32]
    fc (Gemm, transB=1) 32->10                                   [N,10]

Convs have no bias (the BatchNormalization that follows carries it).

How to run (from the repository root), in a throwaway venv:

    python3 -m venv /tmp/trainvenv
    /tmp/trainvenv/bin/pip install torch==2.13.0 numpy onnx onnxruntime scikit-learn
    /tmp/trainvenv/bin/python qtool/demo/train.py

(Use a CPU-only torch build; plain ``pip install torch`` may pull a
multi-GB CUDA build.)  Training takes well under a minute on 2 CPU cores.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
import torch.nn as nn
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

OUT_DIR = Path(__file__).resolve().parent
ONNX_PATH = OUT_DIR / "digits_cnn.onnx"
CALIB_PATH = OUT_DIR / "digits_calib.npz"
HELDOUT_PATH = OUT_DIR / "digits_heldout.npz"

SEED = 0
HELDOUT_FRACTION = 0.30
N_CALIB = 256
EPOCHS = 40
BATCH_SIZE = 64
LR = 3e-3
WEIGHT_DECAY = 1e-4
BN_EPS = 1e-5
OPSET = 13
IR_VERSION = 8

MIN_ACCURACY = 0.95
MAX_ABS_DIFF = 1e-4


def set_determinism(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)


def load_splits():
    """Returns (x_train, y_train, x_held, y_held); x float32 [N,1,8,8] in [0,1]."""
    digits = load_digits()
    x = (digits.images.astype(np.float32) / np.float32(16.0)).reshape(-1, 1, 8, 8)
    y = digits.target.astype(np.int64)
    x_train, x_held, y_train, y_held = train_test_split(
        x, y, test_size=HELDOUT_FRACTION, stratify=y, random_state=SEED
    )
    return (
        np.ascontiguousarray(x_train),
        np.ascontiguousarray(y_train),
        np.ascontiguousarray(x_held),
        np.ascontiguousarray(y_held),
    )


class DigitsCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16, eps=BN_EPS)
        self.block_conv1 = nn.Conv2d(16, 16, 3, padding=1, bias=False)
        self.block_bn1 = nn.BatchNorm2d(16, eps=BN_EPS)
        self.block_conv2 = nn.Conv2d(16, 16, 3, padding=1, bias=False)
        self.block_bn2 = nn.BatchNorm2d(16, eps=BN_EPS)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(32, eps=BN_EPS)
        self.fc = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        r = F.relu(self.block_bn1(self.block_conv1(x)))
        r = self.block_bn2(self.block_conv2(r))
        x = F.relu(x + r)
        x = F.max_pool2d(x, 2, 2)
        x = F.relu(self.bn2(self.conv2(x)))
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.fc(x)


def random_shift(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Light augmentation: shift each image by -1, 0 or +1 pixel in x and y
    (zero fill)."""
    n = x.shape[0]
    padded = F.pad(x, (1, 1, 1, 1))
    dy = torch.randint(0, 3, (n,), generator=gen)
    dx = torch.randint(0, 3, (n,), generator=gen)
    out = torch.empty_like(x)
    for oy in range(3):
        for ox in range(3):
            m = (dy == oy) & (dx == ox)
            if m.any():
                out[m] = padded[m, :, oy : oy + 8, ox : ox + 8]
    return out


def train(x_train: np.ndarray, y_train: np.ndarray) -> DigitsCNN:
    model = DigitsCNN()
    xt = torch.from_numpy(x_train)
    yt = torch.from_numpy(y_train)
    gen = torch.Generator().manual_seed(SEED)
    opt = torch.optim.Adam(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    steps_per_epoch = (len(xt) + BATCH_SIZE - 1) // BATCH_SIZE
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=LR, epochs=EPOCHS, steps_per_epoch=steps_per_epoch
    )
    for epoch in range(EPOCHS):
        model.train()
        perm = torch.randperm(len(xt), generator=gen)
        total_loss = 0.0
        correct = 0
        for i in range(0, len(xt), BATCH_SIZE):
            idx = perm[i : i + BATCH_SIZE]
            xb = random_shift(xt[idx], gen)
            yb = yt[idx]
            logits = model(xb)
            loss = F.cross_entropy(logits, yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            total_loss += loss.item() * len(idx)
            correct += int((logits.argmax(1) == yb).sum())
        if epoch % 5 == 4 or epoch == EPOCHS - 1:
            print(
                f"epoch {epoch + 1:3d}/{EPOCHS}  loss {total_loss / len(xt):.4f}  "
                f"train(aug) acc {correct / len(xt):.4f}"
            )
    model.eval()
    return model


def _f32(t: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(t.detach().cpu().numpy().astype(np.float32))


def build_onnx(model: DigitsCNN) -> onnx.ModelProto:
    """Hand-built ONNX graph from the trained (eval-mode) weights."""
    initializers: list[onnx.TensorProto] = []
    nodes: list[onnx.NodeProto] = []

    def init(name: str, arr: np.ndarray) -> str:
        initializers.append(numpy_helper.from_array(arr, name=name))
        return name

    def conv(name: str, x: str, layer: nn.Conv2d, out: str) -> str:
        assert layer.bias is None
        w = init(f"{name}.weight", _f32(layer.weight))
        nodes.append(
            helper.make_node(
                "Conv", [x, w], [out], name=name,
                kernel_shape=list(layer.kernel_size),
                pads=[layer.padding[0], layer.padding[1]] * 2,
                strides=list(layer.stride),
                dilations=list(layer.dilation),
                group=1,
            )
        )
        return out

    def bn(name: str, x: str, layer: nn.BatchNorm2d, out: str) -> str:
        inputs = [
            x,
            init(f"{name}.scale", _f32(layer.weight)),
            init(f"{name}.bias", _f32(layer.bias)),
            init(f"{name}.mean", _f32(layer.running_mean)),
            init(f"{name}.var", _f32(layer.running_var)),
        ]
        nodes.append(
            helper.make_node(
                "BatchNormalization", inputs, [out], name=name, epsilon=float(layer.eps)
            )
        )
        return out

    def relu(name: str, x: str, out: str) -> str:
        nodes.append(helper.make_node("Relu", [x], [out], name=name))
        return out

    t = conv("conv1", "input", model.conv1, "conv1_out")
    t = bn("bn1", t, model.bn1, "bn1_out")
    block_in = relu("relu1", t, "relu1_out")
    t = conv("block_conv1", block_in, model.block_conv1, "block_conv1_out")
    t = bn("block_bn1", t, model.block_bn1, "block_bn1_out")
    t = relu("block_relu1", t, "block_relu1_out")
    t = conv("block_conv2", t, model.block_conv2, "block_conv2_out")
    t = bn("block_bn2", t, model.block_bn2, "block_bn2_out")
    nodes.append(helper.make_node("Add", [t, block_in], ["block_add_out"], name="block_add"))
    t = relu("block_relu2", "block_add_out", "block_relu2_out")
    nodes.append(
        helper.make_node(
            "MaxPool", [t], ["pool_out"], name="pool", kernel_shape=[2, 2], strides=[2, 2]
        )
    )
    t = conv("conv2", "pool_out", model.conv2, "conv2_out")
    t = bn("bn2", t, model.bn2, "bn2_out")
    t = relu("relu2", t, "relu2_out")
    nodes.append(helper.make_node("GlobalAveragePool", [t], ["gap_out"], name="gap"))
    nodes.append(helper.make_node("Flatten", ["gap_out"], ["flatten_out"], name="flatten", axis=1))
    fc_w = init("fc.weight", _f32(model.fc.weight))  # [10, 32]
    fc_b = init("fc.bias", _f32(model.fc.bias))  # [10]
    nodes.append(
        helper.make_node(
            "Gemm", ["flatten_out", fc_w, fc_b], ["logits"], name="fc",
            alpha=1.0, beta=1.0, transA=0, transB=1,
        )
    )

    graph = helper.make_graph(
        nodes,
        "digits_cnn",
        inputs=[helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 1, 8, 8])],
        outputs=[helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])],
        initializer=initializers,
    )
    model_proto = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        producer_name="qtool-demo-train",
        producer_version="1",
        doc_string="Residual CNN for UCI 8x8 digits; input = pixel/16.0, NCHW [N,1,8,8].",
    )
    model_proto.ir_version = IR_VERSION
    onnx.checker.check_model(model_proto, full_check=True)
    return model_proto


def main() -> int:
    set_determinism(SEED)
    x_train, y_train, x_held, y_held = load_splits()
    rng = np.random.default_rng(SEED)
    calib_idx = np.sort(rng.choice(len(x_train), size=N_CALIB, replace=False))
    x_calib = np.ascontiguousarray(x_train[calib_idx])
    y_calib = np.ascontiguousarray(y_train[calib_idx])
    print(f"train {len(x_train)}  held-out {len(x_held)}  calib {len(x_calib)} (from train)")

    t0 = time.perf_counter()
    model = train(x_train, y_train)
    train_time = time.perf_counter() - t0
    n_params = sum(p.numel() for p in model.parameters())
    print(f"training time {train_time:.1f} s, trainable parameters {n_params}")

    with torch.no_grad():
        torch_logits = model(torch.from_numpy(x_held)).numpy()

    model_proto = build_onnx(model)
    ONNX_PATH.write_bytes(model_proto.SerializeToString())

    # Check with onnxruntime both as-is (which fuses Conv+BN internally) and
    # with all graph optimisations disabled (runs the unfused graph node by node).
    max_diff = 0.0
    ort_logits = None
    for level in (ort.GraphOptimizationLevel.ORT_ENABLE_ALL, ort.GraphOptimizationLevel.ORT_DISABLE_ALL):
        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        so.inter_op_num_threads = 1
        so.graph_optimization_level = level
        sess = ort.InferenceSession(str(ONNX_PATH), so, providers=["CPUExecutionProvider"])
        (out,) = sess.run(["logits"], {"input": x_held})
        max_diff = max(max_diff, float(np.max(np.abs(out - torch_logits))))
        if ort_logits is None:
            ort_logits = out
    torch_acc = float(np.mean(torch_logits.argmax(1) == y_held))
    ort_acc = float(np.mean(ort_logits.argmax(1) == y_held))
    print(f"max |onnxruntime - torch| logits on held-out: {max_diff:.3e}")
    print(f"held-out top-1 accuracy: torch {torch_acc:.4f}  onnxruntime {ort_acc:.4f}")
    if max_diff >= MAX_ABS_DIFF:
        print(f"FAIL: logits differ by {max_diff} >= {MAX_ABS_DIFF}", file=sys.stderr)
        return 1
    if ort_acc < MIN_ACCURACY:
        print(f"FAIL: accuracy {ort_acc} < {MIN_ACCURACY}", file=sys.stderr)
        return 1

    np.savez_compressed(CALIB_PATH, input=x_calib, label=y_calib)
    np.savez_compressed(HELDOUT_PATH, input=x_held, label=y_held)
    for p in (ONNX_PATH, CALIB_PATH, HELDOUT_PATH):
        print(f"wrote {p.name}: {p.stat().st_size} bytes")
    print("nodes: " + ", ".join(f"{n.op_type}:{n.name}" for n in model_proto.graph.node))
    return 0


if __name__ == "__main__":
    sys.exit(main())
