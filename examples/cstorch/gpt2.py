"""A small GPT-2 (tied embedding, causal attention) trained with the Cerebras PyTorch 2.x API:
AdamW, a linear warm-up then cosine decay, dynamic loss scaling, TensorBoard scalars.

    python examples/cstorch/gpt2.py [--num_csx 2] [--steps 20] [--model_dir model_dir/gpt2]
"""
import argparse
import math

import torch
import torch.nn.functional as F

import cs_torch as cstorch


class Block(torch.nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.c_attn, self.c_proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.c_fc, self.mlp_proj = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT2(torch.nn.Module):
    def __init__(self, vocab=64, d=32, heads=4, layers=2, max_len=16):
        super().__init__()
        self.wte, self.wpe = torch.nn.Embedding(vocab, d), torch.nn.Embedding(max_len, d)
        self.h = torch.nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(d)
        for embedding in (self.wte, self.wpe):
            torch.nn.init.normal_(embedding.weight, std=0.02)   # GPT-2's initialisation

    def forward(self, ids):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        for block in self.h:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)     # the output head is the token embedding


def input_fn(batch_size, seq_len=16, vocab=64, num_samples=128):
    """Token sequences with structure to learn: each is an arithmetic progression mod vocab."""
    gen = torch.Generator().manual_seed(0)
    start = torch.randint(0, vocab, (num_samples, 1), generator=gen)
    stride = torch.randint(1, 4, (num_samples, 1), generator=gen)
    seq = (start + stride * torch.arange(seq_len + 1)) % vocab
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(seq[:, :-1], seq[:, 1:]),
                                       batch_size=batch_size, shuffle=True, drop_last=True,
                                       generator=torch.Generator().manual_seed(3))


def schedule(optimizer, warmup, total, peak=3e-3):
    lr = cstorch.optim.lr_scheduler
    return lr.SequentialLR(optimizer, [
        lr.LinearLR(optimizer, initial_learning_rate=0.0, end_learning_rate=peak, total_iters=warmup),
        lr.CosineDecayLR(optimizer, initial_learning_rate=peak, end_learning_rate=peak / 10,
                         total_iters=total - warmup),
    ], milestones=[warmup])


def main(steps=20, num_csx=1, batch_size=8, model_dir="model_dir/gpt2", log=print):
    cstorch.manual_seed(3)
    backend = cstorch.backend("CSX", cluster_config=cstorch.distributed.ClusterConfig(num_csx=num_csx))
    model = GPT2()
    compiled_model = cstorch.compile(model, backend)
    optimizer = cstorch.optim.AdamW(model.parameters(), 3e-3, eps=1e-8, weight_decay=0.01)
    lr_scheduler = schedule(optimizer, warmup=max(steps // 4, 1), total=steps)
    grad_scaler = cstorch.amp.GradScaler(loss_scale="dynamic")
    losses = []

    @cstorch.trace
    def training_step(ids, labels):
        logits = compiled_model(ids)
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1))
        cstorch.summarize_scalar("loss", loss)
        optimizer.zero_grad()
        grad_scaler.scale(loss).backward()
        grad_scaler.unscale_(optimizer)
        grad_scaler.step(optimizer)
        grad_scaler.update()
        lr_scheduler.step()
        return loss

    writer = cstorch.utils.tensorboard.SummaryWriter(log_dir=f"{model_dir}/train")
    executor = cstorch.utils.data.DataExecutor(cstorch.utils.data.DataLoader(input_fn, batch_size),
                                               num_steps=steps, writer=writer)
    for step, (ids, labels) in enumerate(executor, start=1):
        losses.append(training_step(ids, labels).item())
        if step % 5 == 0:
            log(f"step {step}: loss {losses[-1]:.5f} (perplexity {math.exp(losses[-1]):.2f}), "
                f"lr {lr_scheduler.get_last_lr()[0]:.2e}")
    writer.close()
    return losses, model


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--num_csx", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--model_dir", default="model_dir/gpt2")
    a = parser.parse_args()
    main(a.steps, a.num_csx, model_dir=a.model_dir)
