"""Tiny modules written the way transformers, torchvision and timm write theirs: the
idioms that make their graphs (in-place activations and residual adds, batch norm,
depthwise convolutions, hardswish, RMSNorm with pow and rsqrt, rotary embeddings
with cat, class tokens, unbind, padding masks combined with &, labels padded for
the shifted loss). tests/test_torch_idioms.py trains each against torch eager."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, T, D, HEADS = 24, 8, 16, 2


def causal_lm_loss(logits, labels):
    """transformers' ForCausalLMLoss: labels padded by one ignored token, then shifted."""
    labels = F.pad(labels, (0, 1), value=-100)[..., 1:]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=-100)


def masked_lm_loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


class _Heads(nn.Module):
    def split(self, x):
        b, t, _ = x.shape
        return x.view(b, t, HEADS, D // HEADS).transpose(1, 2)


class GPT2Style(_Heads):
    """GPT-2's block: Conv1D-style addmm projections, gelu_new written with pow, a key/value
    'cache' joined with cat, a causal mask as a buffer sliced and used with torch.where."""
    def __init__(self, layers=2):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, D), nn.Embedding(T, D)
        self.ln = nn.ModuleList(nn.LayerNorm(D) for _ in range(2 * layers + 1))
        self.c_attn = nn.ParameterList(nn.Parameter(torch.randn(D, 3 * D) * 0.1) for _ in range(layers))
        self.c_attn_bias = nn.ParameterList(nn.Parameter(torch.zeros(3 * D)) for _ in range(layers))
        self.c_fc = nn.ModuleList(nn.Linear(D, 4 * D) for _ in range(layers))
        self.c_proj = nn.ModuleList(nn.Linear(4 * D, D) for _ in range(layers))
        self.register_buffer("bias", torch.tril(torch.ones(T, T, dtype=torch.bool)).view(1, 1, T, T),
                             persistent=False)

    @staticmethod
    def gelu_new(x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))

    def forward(self, input_ids):
        t = input_ids.shape[1]
        x = self.wte(input_ids) + self.wpe(torch.arange(t))
        for i, (w, b, fc, proj) in enumerate(zip(self.c_attn, self.c_attn_bias, self.c_fc, self.c_proj)):
            h = self.ln[2 * i](x)
            q, k, v = torch.addmm(b, h.view(-1, D), w).view(*h.shape[:2], 3 * D).split(D, dim=2)
            q, k, v = self.split(q), self.split(k), self.split(v)
            past_k, past_v = k[:, :, :0], v[:, :, :0]      # an empty cache, as a first forward has
            k, v = torch.cat((past_k, k), dim=-2), torch.cat((past_v, v), dim=-2)
            scores = q @ k.transpose(-1, -2) / math.sqrt(D // HEADS)
            scores = torch.where(self.bias[:, :, :t, :t], scores, torch.finfo(scores.dtype).min)
            a = (scores.softmax(-1) @ v).transpose(1, 2).reshape(*h.shape)
            x = x + a
            x = x + proj(self.gelu_new(fc(self.ln[2 * i + 1](x))))
        return self.ln[-1](x) @ self.wte.weight.t()


class BertStyle(_Heads):
    """BERT with its padding mask: position ids indexed from a buffer, token types from a
    zero buffer, the mask made from `attention_mask[:, None, None, :].bool() & ...`."""
    def __init__(self):
        super().__init__()
        self.word, self.pos, self.types = nn.Embedding(VOCAB, D), nn.Embedding(T, D), nn.Embedding(2, D)
        self.ln0, self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.out = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.ff1, self.ff2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.head = nn.Linear(D, VOCAB)
        self.register_buffer("position_ids", torch.arange(T).expand((1, -1)), persistent=False)

    def forward(self, input_ids, attention_mask):
        t = input_ids.shape[1]
        positions = self.position_ids[:, :t]
        x = self.word(input_ids) + self.pos.weight[positions] + self.types(torch.zeros_like(input_ids))
        x = self.ln0(x)
        keys = attention_mask[:, None, None, :].bool()
        allowed = keys & torch.ones(t, t, dtype=torch.bool)
        q, k, v = (self.split(p) for p in self.qkv(x).chunk(3, dim=-1))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        x = self.ln1(x + self.out(a.transpose(1, 2).reshape(x.shape)))
        x = self.ln2(x + self.ff2(F.gelu(self.ff1(x))))
        return self.head(x)


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class LlamaStyle(_Heads):
    """Llama's block: RMSNorm, rotary embeddings (cos and sin from an inv_freq buffer),
    SiLU-gated MLP, causal attention through scaled_dot_product_attention."""
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.norm1, self.norm2, self.norm = RMSNorm(D), RMSNorm(D), RMSNorm(D)
        self.q, self.k, self.v, self.o = (nn.Linear(D, D, bias=False) for _ in range(4))
        self.gate, self.up, self.down = nn.Linear(D, 32, bias=False), nn.Linear(D, 32, bias=False), \
            nn.Linear(32, D, bias=False)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)
        hd = D // HEADS
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd)), persistent=False)

    def forward(self, input_ids):
        t = input_ids.shape[1]
        x = self.embed(input_ids)
        freqs = torch.outer(torch.arange(t).float(), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]
        h = self.norm1(x)
        q, k, v = self.split(self.q(h)), self.split(self.k(h)), self.split(self.v(h))
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(x.shape))
        h = self.norm2(x)
        x = x + self.down(F.silu(self.gate(h)) * self.up(h))
        return self.lm_head(self.norm(x))


class BasicBlock(nn.Module):
    """torchvision's ResNet block: conv-bn-relu(inplace), the residual added in place."""
    def __init__(self, cin, cout, stride, track_running_stats):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout, track_running_stats=track_running_stats)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout, track_running_stats=track_running_stats)
        self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                  nn.BatchNorm2d(cout, track_running_stats=track_running_stats)) \
            if stride != 1 or cin != cout else None

    def forward(self, x):
        identity = x if self.down is None else self.down(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class ResNetStyle(nn.Module):
    def __init__(self, classes=5, track_running_stats=False):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(8, track_running_stats=track_running_stats)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = BasicBlock(8, 8, 1, track_running_stats)
        self.layer2 = BasicBlock(8, 16, 2, track_running_stats)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(16, classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class SqueezeExcite(nn.Module):
    def __init__(self, c, squeezed):
        super().__init__()
        self.fc1, self.fc2 = nn.Conv2d(c, squeezed, 1), nn.Conv2d(squeezed, c, 1)

    def forward(self, x):
        scale = F.adaptive_avg_pool2d(x, 1)
        scale = F.hardsigmoid(self.fc2(F.relu(self.fc1(scale), inplace=True)))
        return scale * x


class MobileNetStyle(nn.Module):
    """MobileNetV3's pieces: hardswish in place, depthwise convolution (groups = channels),
    squeeze-excite with hardsigmoid, and a classifier with Dropout(inplace=True)."""
    def __init__(self, classes=5, dropout=0.0):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8, track_running_stats=False),
                                  nn.Hardswish(inplace=True))
        self.dw = nn.Sequential(nn.Conv2d(8, 8, 3, 1, 1, groups=8, bias=False),
                                nn.BatchNorm2d(8, track_running_stats=False), nn.Hardswish(inplace=True))
        self.se = SqueezeExcite(8, 4)
        self.project = nn.Conv2d(8, 12, 1)
        self.classifier = nn.Sequential(nn.Linear(12, 16), nn.Hardswish(inplace=True),
                                        nn.Dropout(p=dropout, inplace=True), nn.Linear(16, classes))

    def forward(self, x):
        x = self.se(self.dw(self.stem(x)))
        x = F.adaptive_avg_pool2d(self.project(x), 1)
        return self.classifier(torch.flatten(x, 1))


class ViTStyle(nn.Module):
    """timm's VisionTransformer: patches by a strided convolution, a class token joined
    with cat, qkv reshaped and unbound, the head reading token 0 (select)."""
    def __init__(self, classes=5, patch=4, image=8):
        super().__init__()
        n = (image // patch) ** 2
        self.patch_embed = nn.Conv2d(3, D, patch, patch)
        self.cls_token = nn.Parameter(torch.randn(1, 1, D) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, n + 1, D) * 0.02)
        self.norm1, self.norm2, self.norm = nn.LayerNorm(D, eps=1e-6), nn.LayerNorm(D, eps=1e-6), \
            nn.LayerNorm(D, eps=1e-6)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.head = nn.Linear(D, classes)

    def forward(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1) + self.pos_embed
        b, n, c = x.shape
        qkv = self.qkv(self.norm1(x)).reshape(b, n, 3, HEADS, c // HEADS).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        attn = (q * (c // HEADS) ** -0.5) @ k.transpose(-2, -1)
        a = (attn.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, n, c)
        x = x + self.proj(a)
        x = x + self.fc2(F.gelu(self.fc1(self.norm2(x))))
        return self.head(self.norm(x)[:, 0])


class UNetStyle(nn.Module):
    """A diffusion UNet's pieces: GroupNorm, SiLU, nearest upsampling, and writes into part
    of a tensor (x[:, 0] = ..., x[..., :2] += ..., scatter_add) that torch's
    functionalization turns into slice_scatter, select_scatter and scatter."""
    def __init__(self, classes=5):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, 2, 1)
        self.norm = nn.GroupNorm(4, 8)
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.conv2 = nn.Conv2d(8, 4, 3, 1, 1)
        self.fc = nn.Linear(4, classes)

    def forward(self, x):
        h = self.up(F.silu(self.norm(self.conv(x))))
        h = self.conv2(h)
        pooled = h.mean(dim=(2, 3)).clone()
        pooled[:, 0] = pooled[:, 1] * 2
        pooled[..., 2:] += pooled[..., :2]
        index = torch.tensor([[0, 1, 1, 3]]).expand(pooled.shape[0], -1)
        pooled = torch.zeros_like(pooled).scatter_add(1, index, pooled) + pooled
        return self.fc(pooled)


class ResamplingStyle(nn.Module):
    """Image resampling, distances and 3-d pooling: reflect, replicate and circular padding,
    bilinear upsampling, a warp by grid_sample, F.fold (col2im), cdist to learned prototypes,
    pdist of them, diagonal, scatter_reduce, max/avg/adaptive 3-d pools."""
    def __init__(self, classes=5):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect")
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1, padding_mode="replicate")
        self.mix = nn.Linear(2, 4)
        self.prototypes = nn.Parameter(torch.randn(classes, 4))

    def forward(self, x):                                                    # [B, 3, 8, 8]
        h = F.interpolate(torch.tanh(self.conv(x)), scale_factor=1.5, mode="bilinear")    # [B, 4, 12, 12]
        h = self.conv2(F.pad(h, (1, 1, 2, 0), mode="circular"))[:, :, 1:-1]            # [B, 4, 12, 14]
        h = F.grid_sample(h, torch.tanh(h[:, :2].permute(0, 2, 3, 1)), align_corners=False) + h   # a warp
        v = h[..., 1:-1].reshape(h.shape[0], 1, 4, 12, 12)
        pooled = F.max_pool3d(v, 2) + F.avg_pool3d(v, 2, stride=2)                      # [B, 1, 2, 6, 6]
        cols = self.mix(pooled.reshape(h.shape[0], 2, 36).transpose(1, 2)).transpose(1, 2)   # [B, 4, 36]
        folded = F.fold(cols, (7, 7), 2)                                                # [B, 1, 7, 7]
        feats = F.adaptive_avg_pool3d(v, (1, 2, 2)).flatten(1) + folded.mean((1, 2, 3))[:, None]   # [B, 4]
        outer = feats[:, :, None] * feats[:, None, :]
        index = torch.tensor([[0, 0, 1, 3]]).expand(feats.shape[0], -1)
        feats = feats.scatter_reduce(1, index, torch.diagonal(outer, dim1=1, dim2=2), "amax")
        # cdist's default mode picks matrix products above 25 rows: a guard on the batch size
        distances = torch.cdist(feats, self.prototypes, compute_mode="donot_use_mm_for_euclid_dist")
        return -distances + F.pdist(self.prototypes).mean()
