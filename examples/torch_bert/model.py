"""A BERT-style encoder in plain PyTorch that takes what a Hugging Face BERT
takes, as separate tensors: input_ids, attention_mask (1 for a real token,
0 for padding) and token_type_ids. Post-norm blocks of bidirectional
self-attention (padding keys masked) and a GELU MLP, a masked-LM head.
Dropout after the embeddings, on the attention probabilities and on each
residual branch. Nothing here knows about the emulator; run.py hands it over.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class BertConfig:
    vocab_size: int = 260
    max_len: int = 64
    type_vocab_size: int = 2
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64
    ffn: int = 256
    dropout: float = 0.0
    attn_dropout: float = 0.0


class SelfAttention(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.qkv = nn.Linear(c.n_embd, 3 * c.n_embd)
        self.proj = nn.Linear(c.n_embd, c.n_embd)
        self.attn_drop = nn.Dropout(c.attn_dropout)
        self.n_head = c.n_head

    def forward(self, x, attention_mask):
        B, T, D = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (t.reshape(B, T, self.n_head, D // self.n_head).permute(0, 2, 1, 3) for t in (q, k, v))
        scores = q @ k.transpose(-2, -1) / (D // self.n_head) ** 0.5
        scores = scores.masked_fill(attention_mask[:, None, None, :] == 0, float("-inf"))
        y = self.attn_drop(scores.softmax(-1)) @ v
        return self.proj(y.permute(0, 2, 1, 3).reshape(B, T, D))


class Layer(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.attn = SelfAttention(c)
        self.ln1 = nn.LayerNorm(c.n_embd)
        self.ff1 = nn.Linear(c.n_embd, c.ffn)
        self.ff2 = nn.Linear(c.ffn, c.n_embd)
        self.ln2 = nn.LayerNorm(c.n_embd)
        self.drop = nn.Dropout(c.dropout)

    def forward(self, x, attention_mask):
        x = self.ln1(x + self.drop(self.attn(x, attention_mask)))
        return self.ln2(x + self.drop(self.ff2(F.gelu(self.ff1(x)))))


class Bert(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.tok = nn.Embedding(c.vocab_size, c.n_embd)
        self.pos = nn.Embedding(c.max_len, c.n_embd)
        self.typ = nn.Embedding(c.type_vocab_size, c.n_embd)
        self.ln = nn.LayerNorm(c.n_embd)
        self.drop = nn.Dropout(c.dropout)
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.n_layer))
        self.head = nn.Linear(c.n_embd, c.vocab_size)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    def forward(self, input_ids, attention_mask, token_type_ids):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.tok(input_ids) + self.pos(positions) + self.typ(token_type_ids)
        x = self.drop(self.ln(x))
        for layer in self.layers:
            x = layer(x, attention_mask)
        return self.head(x)


def mlm_loss(logits, labels):
    """Cross-entropy of the masked tokens (labels -100 elsewhere), mean over them."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
