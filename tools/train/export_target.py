"""Writes a trained Target (model.py) as a qwen35 GGUF in the layout of src/models/synth.cpp.

Matmuls: PTQ1_0 (or PQ2_0) from the SAME codes/scales the training forward used (model.ternary_codes),
prism metadata with our sign vectors and block; GDN V heads reordered from HF grouped order to the
GGUF's tiled order (gguf[r*Hk + k] = hf[k*R + r]) for attn_qkv's V rows, attn_gate, ssm_alpha/beta,
ssm_a, ssm_dt, the V channels of ssm_conv1d (ssm_out's input columns stay grouped: the runtime
permutes its input, prism.hadamard.gdn_v_grouped = true). ssm_alpha/beta BF16, the rest F32.
"""
import argparse
import json

import numpy as np
import torch

import gguf_io as G
from model import Target, TargetConfig, ternary_codes

CHAT_TEMPLATE = ("{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + "
                 "'<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- "
                 "'<|im_start|>assistant\\n' }}{%- endif %}")


def add_tokenizer(w, tok):
    """tok: dict with tokens, token_type, merges, bos, eos, eot, pad, mask."""
    w.string("tokenizer.ggml.model", "gpt2")
    w.string("tokenizer.ggml.pre", "qwen2")
    w.array("tokenizer.ggml.tokens", G.T_STR, tok["tokens"])
    w.array("tokenizer.ggml.token_type", G.T_I32, tok["token_type"])
    w.array("tokenizer.ggml.merges", G.T_STR, tok["merges"])
    w.u32("tokenizer.ggml.bos_token_id", tok["bos"])
    w.u32("tokenizer.ggml.eos_token_id", tok["eos"])
    w.u32("tokenizer.ggml.padding_token_id", tok["pad"])
    w.u32("tokenizer.ggml.mask_token_id", tok["mask"])
    w.boolean("tokenizer.ggml.add_bos_token", False)
    w.string("tokenizer.chat_template", CHAT_TEMPLATE)


def tiled_from_grouped(hk, hv):
    """Index list: tiled head t takes grouped head (t % hk) * R + t // hk."""
    R = hv // hk
    return [(t % hk) * R + t // hk for t in range(hv)]


def export(model: Target, tok, path, gtype=G.PTQ1_0, name="dflash tiny qwen35"):
    c = model.cfg
    w = G.GGUFWriter()
    p = "qwen35."
    w.string("general.architecture", "qwen35")
    w.string("general.name", name)
    w.string("general.type", "model")
    w.u32(p + "block_count", c.n_layer)
    w.u32(p + "context_length", c.n_ctx_train)
    w.u32(p + "embedding_length", c.n_embd)
    w.u32(p + "feed_forward_length", c.n_ff)
    w.u32(p + "attention.head_count", c.n_head)
    w.u32(p + "attention.head_count_kv", c.n_head_kv)
    w.u32(p + "attention.key_length", c.head_dim)
    w.u32(p + "attention.value_length", c.head_dim)
    w.f32(p + "attention.layer_norm_rms_epsilon", c.rms_eps)
    w.f32(p + "rope.freq_base", c.rope_theta)
    w.u32(p + "rope.dimension_count", c.n_rot)
    sec = [c.n_rot // 2 - 2 * (c.n_rot // 6), c.n_rot // 6, c.n_rot // 6, 0]
    w.array(p + "rope.dimension_sections", G.T_I32, sec)
    w.u32(p + "ssm.conv_kernel", c.conv_kernel)
    w.u32(p + "ssm.inner_size", c.inner)
    w.u32(p + "ssm.state_size", c.ssm_head_k)
    w.u32(p + "ssm.time_step_rank", c.ssm_v_heads)
    w.u32(p + "ssm.group_count", c.ssm_k_heads)
    w.u32(p + "full_attention_interval", c.full_attn_interval)
    if tok is not None:
        add_tokenizer(w, tok)

    def f32(t):
        return t.detach().float().cpu().numpy()

    def tern(name, param):
        q, d = ternary_codes(param)
        q, d = q.cpu().numpy(), d.cpu().numpy()
        data = G.pack_ptq1_0(q, d) if gtype == G.PTQ1_0 else G.pack_pq2_0(q, d)
        w.tensor(name, gtype, [param.shape[1], param.shape[0]], data)

    def vec(name, arr, ne=None):
        arr = np.ascontiguousarray(arr, np.float32)
        w.tensor(name, G.F32, ne or [arr.size], arr.reshape(-1).view(np.uint8))

    perm = tiled_from_grouped(c.ssm_k_heads, c.ssm_v_heads)
    dv = c.ssm_head_v
    ch_perm = np.concatenate([np.arange(h * dv, (h + 1) * dv) for h in perm])  # V channel order, tiled

    rotated = []
    tern("token_embd.weight", model.tok_embd)
    vec("output_norm.weight", f32(model.output_norm))
    tern("output.weight", model.output)
    for il, L in enumerate(model.layers):
        b = f"blk.{il}."
        vec(b + "attn_norm.weight", f32(L.attn_norm))
        if c.is_attention(il):
            tern(b + "attn_q.weight", L.wq)
            tern(b + "attn_k.weight", L.wk)
            tern(b + "attn_v.weight", L.wv)
            tern(b + "attn_output.weight", L.wo)
            vec(b + "attn_q_norm.weight", f32(L.q_norm))
            vec(b + "attn_k_norm.weight", f32(L.k_norm))
            rotated += [b + n + ".weight" for n in ("attn_q", "attn_k", "attn_v", "attn_output")]
        else:
            nqk = 2 * c.ssm_k_heads * c.ssm_head_k
            row_perm = torch.tensor(np.concatenate([np.arange(nqk), nqk + ch_perm]))
            tern(b + "attn_qkv.weight", L.w_qkv.detach()[row_perm.to(L.w_qkv.device)])
            tern(b + "attn_gate.weight", L.w_gate.detach()[torch.tensor(ch_perm).to(L.w_gate.device)])
            conv = f32(L.conv1d)[row_perm.numpy()]  # [conv_dim, K]
            vec(b + "ssm_conv1d.weight", conv, [c.conv_kernel, c.conv_dim])
            vec(b + "ssm_dt.bias", f32(L.dt_bias)[perm])
            exact = getattr(L, "ssm_a_exact", None)  # set by load_target_gguf: keeps a re-export bit-exact
            vec(b + "ssm_a", (f32(exact) if exact is not None else -np.exp(f32(L.A_log)))[perm])
            for nm, prm in (("ssm_alpha", L.w_alpha), ("ssm_beta", L.w_beta)):
                arr = f32(prm)[perm]
                w.tensor(b + nm + ".weight", G.BF16, [c.n_embd, c.ssm_v_heads], G.quantize(G.BF16, arr))
            vec(b + "ssm_norm.weight", f32(L.ssm_norm))
            tern(b + "ssm_out.weight", L.w_out)
            rotated += [b + n + ".weight" for n in ("attn_qkv", "attn_gate", "ssm_out")]
        vec(b + "post_attention_norm.weight", f32(L.post_attn_norm))
        tern(b + "ffn_gate.weight", L.ffn_gate)
        tern(b + "ffn_up.weight", L.ffn_up)
        tern(b + "ffn_down.weight", L.ffn_down)
        rotated += [b + n + ".weight" for n in ("ffn_gate", "ffn_up", "ffn_down")]
    rotated.append("output.weight")

    widths = c.widths()
    signs = np.concatenate([f32(getattr(model, f"signs_{wd}")) for wd in widths]).astype(np.int8)
    w.u32("prism.hadamard.version", 1)
    w.u32("prism.hadamard.block_size", c.prism_block)
    w.string("prism.hadamard.transform", "normalized-sylvester-walsh-hadamard")
    w.string("prism.hadamard.axis", "input-last-dimension")
    w.string("prism.hadamard.sign_mode", "explicit")
    w.array("prism.hadamard.sign_widths", G.T_U32, widths)
    w.array("prism.hadamard.sign_values", G.T_I8, signs.tolist())
    w.array("prism.hadamard.weight_names", G.T_STR, rotated)
    w.array("prism.hadamard.inverse_weight_names", G.T_STR, ["token_embd.weight"])
    w.boolean("prism.hadamard.gdn_v_grouped", True)
    w.write(path)


def load_checkpoint(path, device="cpu"):
    ck = torch.load(path, map_location=device)
    cfg = TargetConfig(**ck["cfg"])
    m = Target(cfg).to(device)
    m.load_state_dict(ck["model"])
    return m, ck


def load_target_gguf(path, device="cpu"):
    """The inverse of export(): a Target computing exactly what the GGUF file computes (weights are the
    dequantized ternary values; re-ternarizing them is the identity, so cfg.ternary is switched off)."""
    r = G.GGUFReader(path)
    kv = r.kv
    p = "qwen35."
    te = r.tensors["token_embd.weight"]
    cfg = TargetConfig(n_vocab=te[1][1], n_embd=kv[p + "embedding_length"], n_layer=kv[p + "block_count"],
                       n_ff=kv[p + "feed_forward_length"], n_head=kv[p + "attention.head_count"],
                       n_head_kv=kv[p + "attention.head_count_kv"], head_dim=kv[p + "attention.key_length"],
                       n_rot=kv[p + "rope.dimension_count"], rope_theta=kv[p + "rope.freq_base"],
                       full_attn_interval=kv[p + "full_attention_interval"], conv_kernel=kv[p + "ssm.conv_kernel"],
                       ssm_k_heads=kv[p + "ssm.group_count"], ssm_v_heads=kv[p + "ssm.time_step_rank"],
                       ssm_head_k=kv[p + "ssm.state_size"],
                       ssm_head_v=kv[p + "ssm.inner_size"] // kv[p + "ssm.time_step_rank"],
                       rms_eps=kv[p + "attention.layer_norm_rms_epsilon"],
                       prism_block=kv["prism.hadamard.block_size"], ternary=False,
                       n_ctx_train=kv[p + "context_length"])
    m = Target(cfg)
    c = cfg
    off = 0
    widths = [int(x) for x in kv["prism.hadamard.sign_widths"]]
    signs = np.asarray(kv["prism.hadamard.sign_values"], np.float32)
    assert widths == c.widths(), f"sign widths {widths} != {c.widths()}"
    for wd in widths:
        getattr(m, f"signs_{wd}").copy_(torch.from_numpy(signs[off:off + wd]))
        off += wd
    perm = tiled_from_grouped(c.ssm_k_heads, c.ssm_v_heads)
    inv = np.argsort(perm)  # grouped head g <- tiled head inv[g]
    dv = c.ssm_head_v
    ch_inv = np.concatenate([np.arange(h * dv, (h + 1) * dv) for h in inv])
    nqk = 2 * c.ssm_k_heads * c.ssm_head_k
    row_inv = np.concatenate([np.arange(nqk), nqk + ch_inv])

    def T(name):
        return torch.from_numpy(np.ascontiguousarray(r.f32(name)))

    with torch.no_grad():
        m.tok_embd.copy_(T("token_embd.weight"))
        m.output.copy_(T("output.weight"))
        m.output_norm.copy_(T("output_norm.weight"))
        for il, L in enumerate(m.layers):
            b = f"blk.{il}."
            L.attn_norm.copy_(T(b + "attn_norm.weight"))
            L.post_attn_norm.copy_(T(b + "post_attention_norm.weight"))
            if c.is_attention(il):
                for nm, prm in (("attn_q", L.wq), ("attn_k", L.wk), ("attn_v", L.wv), ("attn_output", L.wo),
                                ("attn_q_norm", L.q_norm), ("attn_k_norm", L.k_norm)):
                    prm.copy_(T(b + nm + ".weight"))
            else:
                L.w_qkv.copy_(T(b + "attn_qkv.weight")[row_inv])
                L.w_gate.copy_(T(b + "attn_gate.weight")[ch_inv])
                L.conv1d.copy_(T(b + "ssm_conv1d.weight")[row_inv])
                L.dt_bias.copy_(T(b + "ssm_dt.bias")[inv])
                L.A_log.copy_(torch.log(-T(b + "ssm_a")[inv]))
                L.register_buffer("ssm_a_exact", T(b + "ssm_a")[inv].clone(), persistent=False)
                L.w_alpha.copy_(T(b + "ssm_alpha.weight")[inv])
                L.w_beta.copy_(T(b + "ssm_beta.weight")[inv])
                L.ssm_norm.copy_(T(b + "ssm_norm.weight"))
                L.w_out.copy_(T(b + "ssm_out.weight"))
            L.ffn_gate.copy_(T(b + "ffn_gate.weight"))
            L.ffn_up.copy_(T(b + "ffn_up.weight"))
            L.ffn_down.copy_(T(b + "ffn_down.weight"))
    tok = None
    if "tokenizer.ggml.tokens" in kv:
        tok = {"tokens": kv["tokenizer.ggml.tokens"], "mask": int(kv["tokenizer.ggml.mask_token_id"]),
               "eos": int(kv["tokenizer.ggml.eos_token_id"]), "bos": int(kv["tokenizer.ggml.bos_token_id"])}
    return m.to(device), tok


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint", help="target.pt (train_target.py) or a target GGUF (re-export, e.g. as PQ2_0)")
    ap.add_argument("out")
    ap.add_argument("--tokenizer-json", help="tok_gguf.json written by corpus.py (with a .pt checkpoint)")
    ap.add_argument("--type", default="ptq1_0", help="ptq1_0 or pq2_0")
    a = ap.parse_args()
    if a.checkpoint.endswith(".gguf"):
        # the file's weights are q*d: re-ternarizing them is the identity, so PTQ1_0 <-> PQ2_0 is lossless
        m, _ = load_target_gguf(a.checkpoint)
        m.cfg.ternary = True
        r = G.GGUFReader(a.checkpoint)
        tk = {k: r.kv["tokenizer.ggml." + k] for k in ("tokens", "token_type", "merges")}
        tok = dict(tk, bos=r.kv["tokenizer.ggml.bos_token_id"], eos=r.kv["tokenizer.ggml.eos_token_id"],
                   pad=r.kv["tokenizer.ggml.padding_token_id"], mask=r.kv["tokenizer.ggml.mask_token_id"])
        tok["token_type"] = [int(x) for x in tok["token_type"]]
        name = r.kv.get("general.name", "dflash tiny qwen35")
    else:
        m, _ = load_checkpoint(a.checkpoint)
        tok = json.load(open(a.tokenizer_json))
        name = "dflash tiny qwen35 (trained, ternary)"
    export(m, tok, a.out, G.TYPE_NAMES[a.type], name=name)
