"""The benchmark's GPT in PyTorch eager, the speed reference of `bash run.sh bench --torch PYTHON`.

torch is not a dependency of this project: PYTHON is another interpreter, one with torch, numpy
and pyyaml (`python3 -m venv /tmp/t && /tmp/t/bin/pip install torch numpy pyyaml`), so this file
imports nothing of MindSpore's and torch only inside the functions that use it.

    PYTHON bench_torch.py torch-reference [--steps N]   the benchmark shape (bench.py), tokens/s
    PYTHON bench_torch.py torch-layernorm              its LayerNorm alone (bench_fusions.py)
"""
import sys
import time

from settings.cli import HelpRequested, parse_command

# the benchmark shape, the same in both frameworks (bench.py trains it with MindSpore)
SHAPE = {"layers": 4, "hidden": 256, "heads": 8, "ffn": 1024, "seq": 256, "vocab": 4096, "batch": 8}


def torch_reference(argv):
    """The benchmark shape in PyTorch eager (GPT-2 blocks, tied embedding, AdamW), on random tokens:
    prints `tokens/s: N` over --steps steps after two warm-up steps."""
    steps = parse_command("torch-reference", argv, {"--steps": (5, int, "timed steps")})[0]["steps"]
    import torch                        # only here: the project's own venv has no torch
    import torch.nn as nn
    import torch.nn.functional as F
    h, heads, s, b = SHAPE["hidden"], SHAPE["heads"], SHAPE["seq"], SHAPE["batch"]
    vocab = SHAPE["vocab"]

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
            self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
            self.fc1, self.fc2 = nn.Linear(h, SHAPE["ffn"]), nn.Linear(SHAPE["ffn"], h)

        def forward(self, x):
            # [b, s, 3h] -> q, k, v [b, heads, s, h / heads]
            q, k, v = (t.view(b, s, heads, -1).transpose(1, 2)
                       for t in self.qkv(self.ln1(x)).split(h, -1))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, s, h))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos = nn.Embedding(vocab, h), nn.Embedding(s, h)
            self.blocks = nn.ModuleList(Block() for _ in range(SHAPE["layers"]))
            self.ln = nn.LayerNorm(h)

        def forward(self, idx, targets):
            x = self.tok(idx) + self.pos(torch.arange(s))
            for block in self.blocks:
                x = block(x)
            logits = self.ln(x) @ self.tok.weight.T
            return F.cross_entropy(logits.view(-1, vocab), targets.view(-1))

    torch.manual_seed(0)
    model = GPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx, targets = torch.randint(0, vocab, (b, s)), torch.randint(0, vocab, (b, s))

    def step():
        optimizer.zero_grad(set_to_none=True)
        model(idx, targets).backward()
        optimizer.step()

    for _ in range(2):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    print(f"tokens/s: {b * s * steps / (time.perf_counter() - start):.1f}")


def torch_layernorm(norms=9, muls=20, rounds=20):
    """PyTorch on the benchmark's [b s, h] = [2048, 256], forward and backward, as
    bench_fusions.layernorm_probe times MindSpore: `norms` LayerNorms chained as
    x = norm(x) / 2 + x, and `muls` products x = x * 0.999 (2 `muls` elementwise passes: the cost
    of one pass). Prints `layernorm: N` and `mul: N`, ms, medians of `rounds`."""
    import torch
    x = torch.randn(SHAPE["batch"] * SHAPE["seq"], SHAPE["hidden"], requires_grad=True)
    layers = [torch.nn.LayerNorm(SHAPE["hidden"]) for _ in range(norms)]

    def norm_chain():
        y = x
        for norm in layers:
            y = norm(y) * 0.5 + y
        y.sum().backward()

    def mul_chain():
        y = x
        for _ in range(muls):
            y = y * 0.999
        y.sum().backward()

    for name, step in (("layernorm", norm_chain), ("mul", mul_chain)):
        times = []
        for _ in range(rounds + 3):
            start = time.perf_counter()
            step()
            times.append(1000 * (time.perf_counter() - start))
        print(f"{name}: {sorted(times[3:])[rounds // 2]:.2f}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["torch-reference"]:
        try:
            torch_reference(sys.argv[2:])
        except HelpRequested as e:
            print(e)
    elif sys.argv[1:2] == ["torch-layernorm"]:
        torch_layernorm()
    else:
        sys.exit("usage: PYTHON bench_torch.py torch-reference [--steps N] | torch-layernorm")
