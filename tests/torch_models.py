"""Plain PyTorch modules the torch-oracle tests capture (tests/test_torch_programs.py)."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, sizes=(12, 16, 8, 5)):
        super().__init__()
        self.fc1, self.fc2, self.out = (nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))
        self.act = nn.Tanh()

    def forward(self, x):
        return self.out(self.act(self.fc2(F.silu(self.fc1(x)))))


class LeNet(nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 5, padding=2)
        self.conv2 = nn.Conv2d(4, 8, 3)
        self.fc1 = nn.Linear(8 * 2 * 2, 32)
        self.fc2 = nn.Linear(32, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)             # [B, 4, 14, 14] -> 7 x 7
        x = F.avg_pool2d(torch.sigmoid(self.conv2(x)), 2)       # 5 x 5 -> 2 x 2
        return self.fc2(F.relu(self.fc1(torch.flatten(x, 1))))


class EncoderLayer(nn.Module):
    """Post-norm (BERT) block with a padding mask on the keys, attention written out."""
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln1 = nn.LayerNorm(d)
        self.ff1 = nn.Linear(d, 2 * d)
        self.ff2 = nn.Linear(2 * d, d)
        self.ln2 = nn.LayerNorm(d)

    def forward(self, x, pad):
        B, T, D = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (t.reshape(B, T, self.heads, D // self.heads).permute(0, 2, 1, 3) for t in (q, k, v))
        scores = q @ k.transpose(-2, -1) / (D // self.heads) ** 0.5
        scores = scores.masked_fill(pad[:, None, None, :], float("-inf"))
        y = (scores.softmax(-1) @ v).permute(0, 2, 1, 3).reshape(B, T, D)
        x = self.ln1(x + self.proj(y))
        return self.ln2(x + self.ff2(F.gelu(self.ff1(x))))


class TinyBert(nn.Module):
    def __init__(self, vocab=30, d=16, heads=2, layers=2, max_len=12, pad_id=0):
        super().__init__()
        self.pad_id = pad_id
        self.tok = nn.Embedding(vocab, d, padding_idx=pad_id)
        self.pos = nn.Embedding(max_len, d)
        self.ln = nn.LayerNorm(d)
        self.layers = nn.ModuleList(EncoderLayer(d, heads) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        pad = ids == self.pad_id
        x = self.ln(self.tok(ids) + self.pos(torch.arange(ids.shape[1])))
        for layer in self.layers:
            x = layer(x, pad)
        return self.head(x)


def token_loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


class BertInputs(nn.Module):
    """A BERT-style encoder taking the three tensors an HF BERT takes, as separate
    inputs: token ids, an attention mask (1 real token, 0 padding) and token types.
    `dropout` (train mode) after the embeddings and on each block's output."""
    def __init__(self, vocab=30, d=16, heads=2, layers=2, max_len=12, types=2, dropout=0.0):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_len, d)
        self.typ = nn.Embedding(types, d)
        self.ln = nn.LayerNorm(d)
        self.drop = nn.Dropout(dropout)
        self.layers = nn.ModuleList(EncoderLayer(d, heads) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, input_ids, attention_mask, token_type_ids):
        pad = attention_mask == 0
        x = self.tok(input_ids) + self.pos(torch.arange(input_ids.shape[1])) + self.typ(token_type_ids)
        x = self.drop(self.ln(x))
        for layer in self.layers:
            x = F.dropout(layer(x, pad), self.drop.p, self.training)
        return self.head(x)


class TwoTower(nn.Module):
    """forward(x, y): two float inputs of different widths, one score."""
    def __init__(self, classes=4):
        super().__init__()
        self.fx = nn.Linear(6, 8)
        self.fy = nn.Linear(3, 8)
        self.out = nn.Linear(8, classes)

    def forward(self, x, y):
        return self.out(torch.tanh(self.fx(x)) * torch.sigmoid(self.fy(y)))


class ViewAttention(nn.Module):
    """Causal attention with the heads found by view(B, T, -1, head_dim), as transformers
    writes it: the -1 sits after the batch, so the shape must follow a shard's rows. Token
    types from a buffer expanded to the batch, as BERT's embeddings make them."""
    def __init__(self, vocab=30, d=32, head_dim=8, max_len=12, noise=0.0):
        super().__init__()
        self.head_dim, self.noise = head_dim, noise   # noise: the embeddings' std of Gaussian noise
        self.register_buffer("token_type_ids", torch.ones((1, max_len), dtype=torch.long), persistent=False)
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_len, d)
        self.typ = nn.Embedding(2, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        B, T = ids.shape
        x = self.tok(ids) + self.pos(torch.arange(T)) + self.typ(self.token_type_ids[:, :T].expand(B, T))
        if self.noise:
            x = x + self.noise * torch.randn_like(x)
        q, k, v = self.qkv(x).split(x.shape[-1], dim=-1)
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(B * T, -1).view(B, T, -1)    # B * T in one dim, then back
        return self.head(x + self.proj(y))


class TypeBuffer(nn.Module):
    """BERT's embeddings without a mask or token types given: a registered token_type_ids
    buffer sliced to T and expanded to the batch, and an all-ones attention mask of
    [B, T] made in forward(); both must fit a shard of any number of rows."""
    def __init__(self, vocab=30, d=16, max_len=12, types=2):
        super().__init__()
        self.register_buffer("token_type_ids", torch.zeros((1, max_len), dtype=torch.long), persistent=False)
        self.tok = nn.Embedding(vocab, d)
        self.typ = nn.Embedding(types, d)
        self.layer = EncoderLayer(d, 2)
        self.head = nn.Linear(d, vocab)

    def forward(self, input_ids):
        batch, seq = input_ids.shape
        types = self.token_type_ids[:, :seq].expand(batch, seq)
        mask = torch.ones((batch, seq), dtype=torch.long)
        x = self.tok(input_ids) + self.typ(types)
        return self.head(self.layer(x, mask == 0))


class FixedBatch(nn.Module):
    """A buffer of the capture's batch size: no program of it holds for another shard."""
    def __init__(self, batch=8, d=12, classes=5):
        super().__init__()
        self.register_buffer("scale", torch.ones(batch, d))
        self.fc = nn.Linear(d, classes)

    def forward(self, x):
        return self.fc(x * self.scale)


class HFStyleAttention(nn.Module):
    """Self-attention as transformers' BERT writes it: position ids and token types from
    buffers, an all-ones mask made in forward() and extended to an additive mask of
    finfo.min, heads by view((*input_shape, -1, head_dim)), back by reshape(*input_shape, -1)."""
    def __init__(self, vocab=30, d=32, heads=4, max_len=12):
        super().__init__()
        self.head_dim = d // heads
        self.register_buffer("position_ids", torch.arange(max_len).expand((1, -1)), persistent=False)
        self.register_buffer("token_type_ids", torch.zeros(self.position_ids.size(), dtype=torch.long),
                             persistent=False)
        self.tok, self.pos, self.typ = nn.Embedding(vocab, d), nn.Embedding(max_len, d), nn.Embedding(2, d)
        self.query, self.key, self.value, self.out = (nn.Linear(d, d) for _ in range(4))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, input_ids):
        input_shape = input_ids.size()
        batch_size, seq_length = input_shape
        types = self.token_type_ids[:, :seq_length].expand(batch_size, seq_length)
        x = self.ln(self.tok(input_ids) + self.pos(self.position_ids[:, :seq_length]) + self.typ(types))
        extended = torch.ones((batch_size, seq_length))[:, None, None, :].to(x.dtype)
        extended = (1.0 - extended) * torch.finfo(x.dtype).min
        hidden_shape = (*input_shape, -1, self.head_dim)
        q, k, v = (f(x).view(hidden_shape).transpose(1, 2) for f in (self.query, self.key, self.value))
        scores = torch.matmul(q, k.transpose(-1, -2)) / self.head_dim ** 0.5 + extended
        y = torch.matmul(scores.softmax(-1), v).transpose(1, 2).contiguous().reshape(*input_shape, -1)
        return self.head(x + self.out(y))


class RowIndexedMask(nn.Module):
    """transformers' mask idiom: `mask[torch.arange(B)[:, None, None], kv]` picks each row's own
    padding mask with an arange of the batch size, which on a shard must count the shard's rows."""

    def __init__(self, vocab: int = 30, width: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids):
        keep = ids > 3                                               # [B, T] per row
        rows = torch.arange(ids.shape[0])[:, None]
        cols = torch.arange(ids.shape[1])[None, :]
        picked = keep[rows, cols]                                    # aten.index with the batch's arange
        return self.head(self.embed(ids) * picked.unsqueeze(-1).float())


class RowNumberAsValue(nn.Module):
    """An arange of the batch size used as a value: each row's number in the batch, which a shard
    cannot know. Must be refused at capture."""

    def __init__(self, vocab: int = 30, width: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids):
        row = torch.arange(ids.shape[0], dtype=torch.float32)[:, None, None]
        return self.head(self.embed(ids) + row)


class VAE(nn.Module):
    """A variational autoencoder's reparameterisation: z = mu + exp(logvar / 2) * randn_like(mu),
    drawn anew each step; forward gives (reconstruction, mu, logvar) for vae_loss."""
    def __init__(self, features=12, hidden=16, latent=4):
        super().__init__()
        self.enc = nn.Linear(features, hidden)
        self.mu, self.logvar = nn.Linear(hidden, latent), nn.Linear(hidden, latent)
        self.dec = nn.Sequential(nn.Linear(latent, hidden), nn.Tanh(), nn.Linear(hidden, features))

    def forward(self, x):
        h = torch.tanh(self.enc(x))
        mu, logvar = self.mu(h), self.logvar(h)
        return self.dec(mu + torch.exp(0.5 * logvar) * torch.randn_like(mu)), mu, logvar


def vae_loss(out, x):
    recon, mu, logvar = out
    kl = -0.5 * (1 + logvar - mu * mu - logvar.exp()).sum(-1).mean()
    return F.mse_loss(recon, x) + 0.1 * kl


class Draws(nn.Module):
    """Every draw capture takes: rand and randn of the batch's rows and of a fixed shape,
    rand_like of a [B*T, D] view, and a randperm of the features."""
    def __init__(self, features=6, classes=3):
        super().__init__()
        self.fc, self.out = nn.Linear(features, features), nn.Linear(features, classes)

    def forward(self, x):
        B = x.shape[0]
        h = self.fc(x) + torch.rand(B, x.shape[1]) + 0.1 * torch.randn(x.shape[1])
        h = h.view(B * 2, -1)
        h = (h * torch.rand_like(h)).view(B, -1) + torch.randn(B, x.shape[1])
        return self.out(h[:, torch.randperm(x.shape[1])])
