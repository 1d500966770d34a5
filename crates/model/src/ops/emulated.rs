//! The GPU layers' ops (`lazarus_kernels::ops`, what `ops/cuda` runs on a GPU) run on the CPU
//! emulator of CUDA's execution model, against the fused CPU kernels and their autograd: forward
//! and every gradient in f64 to 1e-10, the f32 paths to f32 rounding and the bf16 paths to bf16's.
//! Each check runs twice, the threads of a block in both orders (a missing barrier shows as a
//! difference). The same ops run on a GPU in `on_device.rs`.

use candle_core::{DType, Device, Tensor, Var};
use lazarus_kernels::emulator::{Emulator, HostBuffer};
use lazarus_kernels::{ops, AttentionKernels, Device as _, Dtype, Heads};

use super::testing;

const ORDERS: [Emulator; 2] = [Emulator { reverse: false }, Emulator { reverse: true }];

/// A tensor's values as a host buffer of `dt`.
fn buf(t: &Tensor, dt: Dtype) -> HostBuffer {
    HostBuffer::from_f64(dt, &t.flatten_all().unwrap().to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap())
}

/// A host buffer of `dt` as an f64 tensor of `shape` (its first elements).
fn tensor(b: &HostBuffer, dt: Dtype, shape: &[usize]) -> Tensor {
    let n: usize = shape.iter().product();
    Tensor::from_vec(b.to_f64(dt)[..n].to_vec(), shape, &Device::Cpu).unwrap()
}

/// |a − b| ≤ tol · max(1, max |a|) everywhere (a NaN never passes).
fn close(what: &str, a: &Tensor, b: &Tensor, tol: f64) {
    assert_eq!(a.elem_count(), b.elem_count(), "{what}: sizes");
    if a.elem_count() == 0 {
        return;
    }
    let scale = a.abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f64>().unwrap().max(1.0);
    let d = testing::max_diff(a, b);
    assert!(d <= tol * scale, "{what}: differs by {d} (scale {scale}, tolerance {tol})");
}

/// f(inputs) and the gradient of Σ f·probe for each input, by the CPU kernels and autograd, in f64.
fn reference(inputs: &[Var], probe: &Tensor, f: impl Fn(&[Tensor]) -> Tensor) -> (Tensor, Vec<Tensor>) {
    let ts: Vec<Tensor> = inputs.iter().map(|v| v.as_tensor().clone()).collect();
    let y = f(&ts);
    let g = (&y * probe).unwrap().sum_all().unwrap().backward().unwrap();
    let grads = inputs.iter().map(|v| g.get(v.as_tensor()).cloned().unwrap_or_else(|| v.as_tensor().zeros_like().unwrap())).collect();
    (y, grads)
}

#[test]
fn layer_norm_forward_and_gradients() {
    let (n, d) = (37, 70);
    let mut var = testing::vars(3, 1.0);
    let (x, w, b, probe) = (var(&[n, d]), var(&[d]), var(&[d]), var(&[n, d]));
    let (y, g) =
        reference(&[x.clone(), w.clone(), b.clone()], probe.as_tensor(), |t| super::layer_norm(&t[0], &t[1], &t[2], 1e-5).unwrap());
    for e in ORDERS {
        for (x_dt, y_dt, tol) in [(Dtype::F64, Dtype::F64, 1e-10), (Dtype::F32, Dtype::F32, 2e-5), (Dtype::F32, Dtype::Bf16, 2e-2)] {
            let (xb, wb, bb, pb) =
                (buf(x.as_tensor(), x_dt), buf(w.as_tensor(), x_dt), buf(b.as_tensor(), x_dt), buf(probe.as_tensor(), y_dt));
            let (yb, saved) = ops::layer_norm_fwd(&e, x_dt, y_dt, xb.addr(), wb.addr(), bb.addr(), n, d, 1e-5).unwrap();
            close(&format!("layer norm {x_dt:?}→{y_dt:?} forward"), &y, &tensor(&yb, y_dt, &[n, d]), tol);
            let (dx, dwdb) = ops::layer_norm_bwd(&e, x_dt, y_dt, xb.addr(), wb.addr(), pb.addr(), &saved, n, d).unwrap();
            close("layer norm dx", &g[0], &tensor(&dx, x_dt, &[n, d]), tol);
            let both = tensor(&dwdb, x_dt, &[2 * d]);
            close("layer norm dw", &g[1], &both.narrow(0, 0, d).unwrap(), tol);
            close("layer norm db", &g[2], &both.narrow(0, d, d).unwrap(), tol);
        }
    }
}

#[test]
fn rms_norm_forward_and_gradients() {
    // Rows of a width under one warp, of several warps with a partial one, and enough rows for
    // the weight's gradient to be summed in several parts.
    for (n, d) in [(37, 70), (5, 20), (301, 129)] {
        let mut var = testing::vars(19, 1.0);
        let (x, w, probe) = (var(&[n, d]), var(&[d]), var(&[n, d]));
        let (y, g) = reference(&[x.clone(), w.clone()], probe.as_tensor(), |t| super::rms_norm(&t[0], &t[1], 1e-5).unwrap());
        let orders: &[Emulator] = if n > 100 { &ORDERS[..1] } else { &ORDERS };
        for &e in orders {
            for (x_dt, y_dt, tol) in [(Dtype::F64, Dtype::F64, 1e-10), (Dtype::F32, Dtype::F32, 2e-5), (Dtype::F32, Dtype::Bf16, 2e-2)] {
                let (xb, wb, pb) = (buf(x.as_tensor(), x_dt), buf(w.as_tensor(), x_dt), buf(probe.as_tensor(), y_dt));
                let what = format!("rms norm {x_dt:?}→{y_dt:?} {n}×{d}");
                let (yb, saved) = ops::rms_norm_fwd(&e, x_dt, y_dt, xb.addr(), wb.addr(), n, d, 1e-5).unwrap();
                close(&format!("{what} forward"), &y, &tensor(&yb, y_dt, &[n, d]), tol);
                let (dx, dw) = ops::rms_norm_bwd(&e, x_dt, y_dt, xb.addr(), wb.addr(), pb.addr(), &saved, n, d).unwrap();
                close(&format!("{what} dx"), &g[0], &tensor(&dx, x_dt, &[n, d]), tol);
                close(&format!("{what} dw"), &g[1], &tensor(&dw, x_dt, &[d]), tol);
            }
        }
    }
}

/// Rotary positions: the turn of q and k (v copied) against the CPU kernel, and its gradient —
/// the same kernel turning the probe back — against autograd's, in every type; heads of 4 and of
/// 64 columns, two bases.
#[test]
fn rope_forward_and_gradients() {
    for (b, t, heads, dh, theta) in [(2, 7, 3, 4, 10_000.0), (1, 33, 2, 64, 1e6)] {
        let d = heads * dh;
        let mut var = testing::vars(23, 1.0);
        let (qkv, probe) = (var(&[b, t, 3 * d]), var(&[b, t, 3 * d]));
        let (y, g) = reference(std::slice::from_ref(&qkv), probe.as_tensor(), |x| super::rope(&x[0], heads, theta).unwrap());
        for e in ORDERS {
            for (dt, tol) in [(Dtype::F64, 1e-10), (Dtype::F32, 2e-5), (Dtype::Bf16, 2e-2)] {
                let (qb, pb) = (buf(qkv.as_tensor(), dt), buf(probe.as_tensor(), dt));
                let what = format!("rope {dt:?} b{b} t{t} h{heads} dh{dh}");
                let yb = ops::rope(&e, dt, qb.addr(), Heads { batch: b, seq: t, heads, head_dim: dh }, theta, false).unwrap();
                close(&format!("{what} forward"), &y, &tensor(&yb, dt, &[b, t, 3 * d]), tol);
                let gb = ops::rope(&e, dt, pb.addr(), Heads { batch: b, seq: t, heads, head_dim: dh }, theta, true).unwrap();
                close(&format!("{what} gradient"), &g[0], &tensor(&gb, dt, &[b, t, 3 * d]), tol);
            }
        }
    }
    // A head of an odd width has no pairs to turn: refused before any launch.
    let e = ORDERS[0];
    let qb = HostBuffer::from_f64(Dtype::F32, &[0.0; 9]);
    let err =
        ops::rope(&e, Dtype::F32, qb.addr(), Heads { batch: 1, seq: 1, heads: 1, head_dim: 3 }, 1e4, false).err().unwrap().to_string();
    assert!(err.contains("heads of 3"), "{err}");
}

/// SwiGLU on its own (a shared expert's activation) against the composite SiLU(gate) ⊙ up.
#[test]
fn swiglu_forward_and_gradients() {
    let (n, f) = (29, 45);
    let mut var = testing::vars(29, 2.0);
    let (h, probe) = (var(&[n, 2 * f]), var(&[n, f]));
    let (y, g) = reference(std::slice::from_ref(&h), probe.as_tensor(), |x| super::composite::swiglu(&x[0]).unwrap());
    for e in ORDERS {
        for (dt, tol) in [(Dtype::F64, 1e-10), (Dtype::F32, 2e-5), (Dtype::Bf16, 2e-2)] {
            let (hb, pb) = (buf(h.as_tensor(), dt), buf(probe.as_tensor(), dt));
            let ab = ops::swiglu_fwd(&e, dt, hb.addr(), n, f).unwrap();
            close(&format!("swiglu {dt:?} forward"), &y, &tensor(&ab, dt, &[n, f]), tol);
            let gb = ops::swiglu_bwd(&e, dt, hb.addr(), pb.addr(), n, f).unwrap();
            close(&format!("swiglu {dt:?} gradient"), &g[0], &tensor(&gb, dt, &[n, 2 * f]), tol);
        }
    }
}

#[test]
fn softmax_and_cross_entropy_forward_and_gradients() {
    let (n, v) = (29, 300);
    let mut var = testing::vars(5, 2.0);
    let (x, probe) = (var(&[n, v]), var(&[n, v]));
    let (y, g) = reference(std::slice::from_ref(&x), probe.as_tensor(), |t| super::softmax_last(&t[0]).unwrap());
    let targets: Vec<u32> = (0..n as u32).map(|i| (i * 37 + 11) % v as u32).collect();
    let upstream = Tensor::new(0.7f64, &Device::Cpu).unwrap();
    let (loss, gl) = reference(std::slice::from_ref(&x), &upstream, |t| super::cross_entropy(&t[0], &targets).unwrap());
    for e in ORDERS {
        for (dt, tol) in [(Dtype::F64, 1e-10), (Dtype::F32, 2e-5)] {
            let (xb, pb) = (buf(x.as_tensor(), dt), buf(probe.as_tensor(), dt));
            let yb = ops::softmax_fwd(&e, dt, xb.addr(), n, v).unwrap();
            close("softmax forward", &y, &tensor(&yb, dt, &[n, v]), tol);
            let dx = ops::softmax_bwd(&e, dt, yb.addr(), pb.addr(), n, v).unwrap();
            close("softmax gradient", &g[0], &tensor(&dx, dt, &[n, v]), tol);
            let (lb, saved) = ops::cross_entropy_fwd(&e, dt, xb.addr(), &targets, v).unwrap();
            close("cross entropy", &loss, &tensor(&lb, dt, &[]), tol);
            let ub = buf(&upstream, dt);
            let dx = ops::cross_entropy_bwd(&e, dt, xb.addr(), &saved, ub.addr(), n, v).unwrap();
            close("cross entropy gradient", &gl[0], &tensor(&dx, dt, &[n, v]), tol);
        }
    }
    // A target past the classes is refused before anything reads the logits.
    let xb = buf(x.as_tensor(), Dtype::F32);
    let err = ops::cross_entropy_fwd(&ORDERS[0], Dtype::F32, xb.addr(), &[0, v as u32], v).err().unwrap().to_string();
    assert!(err.contains(&format!("id {v} at 1")), "{err}");
}

#[test]
fn attention_forward_and_gradients() {
    attention_against_the_cpu(AttentionKernels::Simt, &[(2, 7, 3, 4), (1, 70, 2, 6), (1, 130, 2, 64), (1, 33, 1, 100)]);
}

/// The tensor-core kernels (bf16 heads of 64 columns; the other types take the SIMT ones): a
/// partial tile, and three query tiles with a partial last one, over two sequences and heads.
#[test]
fn attention_on_tensor_cores_forward_and_gradients() {
    // These shapes do take the tensor-core kernels (and unaligned buffers do not).
    let h = Heads { batch: 2, seq: 150, heads: 2, head_dim: 64 };
    let kernel =
        |qkv: u64| lazarus_kernels::attention_fwd(AttentionKernels::TensorCores, Dtype::Bf16, qkv, 0x2000, 0x3000, h).unwrap().kernel;
    assert_eq!(kernel(0x1000), "lazarus_attn_mma_fwd_bf16_64");
    assert_eq!(kernel(0x1008), "lazarus_attn_fwd_bf16_32");
    attention_against_the_cpu(AttentionKernels::TensorCores, &[(1, 20, 1, 64), (2, 150, 2, 64)]);
}

fn attention_against_the_cpu(kernels: AttentionKernels, shapes: &[(usize, usize, usize, usize)]) {
    // One tile and a partial one, several tiles, and the model's head width over two query tiles.
    for &(b, t, heads, dh) in shapes {
        let (d, shape) = (heads * dh, Heads { batch: b, seq: t, heads, head_dim: dh });
        let mut var = testing::vars(7, 1.0);
        let (qkv, probe) = (var(&[b, t, 3 * d]), var(&[b, t, d]));
        let (y, g) = reference(std::slice::from_ref(&qkv), probe.as_tensor(), |x| super::causal_attention(&x[0], heads).unwrap());
        let orders: &[Emulator] = if t > 100 { &ORDERS[..1] } else { &ORDERS };
        for &e in orders {
            for (dt, tol) in [(Dtype::F64, 1e-10), (Dtype::F32, 2e-5), (Dtype::Bf16, 3e-2)] {
                let (qb, pb) = (buf(qkv.as_tensor(), dt), buf(probe.as_tensor(), dt));
                let (yb, lse) = ops::attention_fwd(&e, kernels, dt, qb.addr(), shape).unwrap();
                let what = format!("attention {dt:?} b{b} t{t} h{heads} dh{dh}");
                close(&format!("{what} forward"), &y, &tensor(&yb, dt, &[b, t, d]), tol);
                let dq = ops::attention_bwd(&e, kernels, dt, qb.addr(), yb.addr(), pb.addr(), lse.addr(), shape).unwrap();
                close(&format!("{what} gradient"), &g[0], &tensor(&dq, dt, &[b, t, 3 * d]), tol * 4.0);
            }
        }
    }
}

#[test]
fn gather_combine_and_embedding_forward_and_gradients() {
    let (n, d) = (23, 40);
    let mut var = testing::vars(11, 1.0);
    // Tokens repeated, one token never gathered.
    let tokens: Vec<u32> = (0..2 * n as u32).map(|i| (i * 5 + 3) % (n as u32 - 1)).collect();
    let r = tokens.len();
    let (src, probe_g) = (var(&[n, d]), var(&[r, d]));
    let (y, g) = reference(std::slice::from_ref(&src), probe_g.as_tensor(), |t| super::gather_rows(&t[0], &tokens).unwrap());
    let (rows, w, probe_c) = (var(&[r, d]), var(&[r]), var(&[n, d]));
    let (out, gc) = reference(&[rows.clone(), w.clone()], probe_c.as_tensor(), |t| super::combine_rows(&t[0], &t[1], &tokens, n).unwrap());
    for e in ORDERS {
        for (dt, tol) in [(Dtype::F64, 1e-12), (Dtype::F32, 1e-6)] {
            let sb = buf(src.as_tensor(), dt);
            let yb = ops::gather_rows_fwd(&e, dt, sb.addr(), &tokens, n, d).unwrap();
            close("gather", &y, &tensor(&yb, dt, &[r, d]), tol);
            let pb = buf(probe_g.as_tensor(), dt);
            let ds = ops::gather_rows_bwd(&e, dt, dt, pb.addr(), &tokens, n, d).unwrap();
            close("gather gradient", &g[0], &tensor(&ds, dt, &[n, d]), tol);
            let (rb, wb, pc) = (buf(rows.as_tensor(), dt), buf(w.as_tensor(), dt), buf(probe_c.as_tensor(), dt));
            let ob = ops::combine_rows_fwd(&e, dt, dt, rb.addr(), wb.addr(), None, &tokens, n, d).unwrap();
            close("combine", &out, &tensor(&ob, dt, &[n, d]), tol);
            let (dy, dw) = ops::combine_rows_bwd(&e, dt, dt, rb.addr(), wb.addr(), None, pc.addr(), &tokens, n, d).unwrap();
            close("combine rows gradient", &gc[0], &tensor(&dy, dt, &[r, d]), tol);
            close("combine weights gradient", &gc[1], &tensor(&dw, dt, &[r]), tol * 10.0);
        }
        // bf16 rows combined into f32 (mixed precision): the f32 sums of the rounded rows.
        let (rb, wb, pc) = (buf(rows.as_tensor(), Dtype::Bf16), buf(w.as_tensor(), Dtype::F32), buf(probe_c.as_tensor(), Dtype::F32));
        let ob = ops::combine_rows_fwd(&e, Dtype::Bf16, Dtype::F32, rb.addr(), wb.addr(), None, &tokens, n, d).unwrap();
        close("combine bf16 → f32", &out, &tensor(&ob, Dtype::F32, &[n, d]), 1e-2);
        let (dy, dw) = ops::combine_rows_bwd(&e, Dtype::Bf16, Dtype::F32, rb.addr(), wb.addr(), None, pc.addr(), &tokens, n, d).unwrap();
        close("combine bf16 rows gradient", &gc[0], &tensor(&dy, Dtype::Bf16, &[r, d]), 1e-2);
        close("combine bf16 weights gradient", &gc[1], &tensor(&dw, Dtype::F32, &[r]), 5e-2);
    }
    // Weights per assignment slot (what the model passes: no gather of the weights): row r reads
    // slot perm[r] of 2R slots; the slots no row names get zero gradients.
    let perm: Vec<u32> = (0..r as u32).map(|i| (i * 7 + 3) % (2 * r as u32)).collect();
    let slot_w: Vec<f64> = testing::data(2 * r, 17);
    let per_row = Tensor::from_vec(perm.iter().map(|&s| slot_w[s as usize]).collect::<Vec<_>>(), r, &Device::Cpu).unwrap();
    let (sout, sg) = reference(&[rows.clone(), Var::from_tensor(&per_row).unwrap()], probe_c.as_tensor(), |t| {
        super::combine_rows(&t[0], &t[1], &tokens, n).unwrap()
    });
    for e in ORDERS {
        let (rb, wb, pc) =
            (buf(rows.as_tensor(), Dtype::F64), HostBuffer::from_f64(Dtype::F64, &slot_w), buf(probe_c.as_tensor(), Dtype::F64));
        let slots = Some((perm.as_slice(), 2 * r));
        let ob = ops::combine_rows_fwd(&e, Dtype::F64, Dtype::F64, rb.addr(), wb.addr(), slots, &tokens, n, d).unwrap();
        close("combine by slots", &sout, &tensor(&ob, Dtype::F64, &[n, d]), 1e-12);
        let (dy, dw) = ops::combine_rows_bwd(&e, Dtype::F64, Dtype::F64, rb.addr(), wb.addr(), slots, pc.addr(), &tokens, n, d).unwrap();
        close("combine by slots: rows gradient", &sg[0], &tensor(&dy, Dtype::F64, &[r, d]), 1e-12);
        let dw = dw.to_f64(Dtype::F64);
        for (s, &g) in dw.iter().enumerate() {
            match perm.iter().position(|&p| p as usize == s) {
                Some(row) => assert!((g - sg[1].get(row).unwrap().to_scalar::<f64>().unwrap()).abs() < 1e-10, "slot {s}"),
                None => assert_eq!(g, 0.0, "slot {s} is named by no row"),
            }
        }
        let twice = vec![0u32; r];
        let err =
            ops::combine_rows_fwd(&e, Dtype::F64, Dtype::F64, rb.addr(), wb.addr(), Some((&twice, 2 * r)), &tokens, n, d).err().unwrap();
        assert!(err.to_string().contains("slot 0 named twice"), "{err}");
    }
    // The embedding: ids repeated, sequences of 5.
    let cfg = crate::ModelConfig {
        vocab_size: 11,
        d_model: 8,
        n_layers: 1,
        n_heads: 2,
        max_seq_len: 9,
        n_experts: 2,
        d_ff: 4,
        ..Default::default()
    };
    let model = crate::MoeModel::new(&cfg, 4, DType::F64, &Device::Cpu).unwrap();
    let (bt, t) = (3, 5);
    let ids: Vec<u32> = (0..(bt * t) as u32).map(|i| (i * 7) % 5).collect();
    let x = model.embed(&Tensor::from_vec(ids.clone(), (bt, t), &Device::Cpu).unwrap()).unwrap();
    let probe = Tensor::from_vec(testing::data(bt * t * 8, 3), (bt, t, 8), &Device::Cpu).unwrap();
    let grads = (&x * &probe).unwrap().sum_all().unwrap().backward().unwrap();
    let (tok, pos) = (model.params().get("tok_emb").unwrap(), model.params().get("pos_emb").unwrap());
    for e in ORDERS {
        let (tb, pb) = (buf(tok.as_tensor(), Dtype::F64), buf(pos.as_tensor(), Dtype::F64));
        let ob = ops::embed_fwd(&e, Dtype::F64, tb.addr(), pb.addr(), &ids, 11, t, 8).unwrap();
        close("embedding", &x.flatten_all().unwrap(), &tensor(&ob, Dtype::F64, &[bt * t * 8]), 1e-12);
        let gb = buf(&probe, Dtype::F64);
        let (dtok, dpos) = ops::embed_bwd(&e, Dtype::F64, gb.addr(), &ids, 11, t, 8).unwrap();
        close("token table gradient", grads.get(tok.as_tensor()).unwrap(), &tensor(&dtok, Dtype::F64, &[11, 8]), 1e-12);
        close(
            "position table gradient",
            &grads.get(pos.as_tensor()).unwrap().narrow(0, 0, t).unwrap(),
            &tensor(&dpos, Dtype::F64, &[t, 8]),
            1e-12,
        );
    }
}

/// The experts as grouped products (one expert without rows) against the fused CPU node: output,
/// the rows' gradient and every weight's, with GELU and with SwiGLU (a first product twice as
/// wide).
#[test]
fn grouped_experts_forward_and_gradients() {
    use crate::config::Activation;
    let (d, f) = (12, 20);
    let counts = [9usize, 0, 20, 8];
    let r: usize = counts.iter().sum();
    for act in [Activation::Gelu, Activation::Swiglu] {
        let kernels_act = lazarus_kernels::Activation::from(act);
        let f1 = kernels_act.first_width(f);
        let mut var = testing::vars(13, 0.5);
        let x = var(&[r, d]);
        let weights: Vec<[Var; 4]> = counts.iter().map(|_| [var(&[d, f1]), var(&[f1]), var(&[f, d]), var(&[d])]).collect();
        let probe = var(&[r, d]);
        let mut inputs = vec![x.clone()];
        inputs.extend(weights.iter().flat_map(|w| w.iter().cloned()));
        let (y, g) = reference(&inputs, probe.as_tensor(), |t| {
            let experts: Vec<[&Tensor; 4]> =
                (0..counts.len()).map(|e| [&t[1 + 4 * e], &t[2 + 4 * e], &t[3 + 4 * e], &t[4 + 4 * e]]).collect();
            super::grouped_expert_ffn(&t[0], &experts, &counts, act).unwrap()
        });
        for e in ORDERS {
            for (dt, tol) in [(Dtype::F64, 1e-10), (Dtype::F32, 2e-5), (Dtype::Bf16, 5e-2)] {
                let acc = dt.acc();
                let xb = buf(x.as_tensor(), dt);
                let bufs: Vec<[HostBuffer; 4]> = weights
                    .iter()
                    .map(|w| [buf(w[0].as_tensor(), dt), buf(w[1].as_tensor(), acc), buf(w[2].as_tensor(), dt), buf(w[3].as_tensor(), acc)])
                    .collect();
                let addrs: Vec<ops::ExpertAddrs> =
                    bufs.iter().map(|b| ops::ExpertAddrs { w1: b[0].addr(), b1: b[1].addr(), w2: b[2].addr(), b2: b[3].addr() }).collect();
                let (yb, saved) = ops::grouped_ffn_fwd(&e, dt, kernels_act, xb.addr(), &addrs, &counts, d, f).unwrap();
                let what = format!("grouped {act:?} experts {dt:?}");
                close(&format!("{what} forward"), &y, &tensor(&yb, dt, &[r, d]), tol);
                let pb = buf(probe.as_tensor(), dt);
                let gr = ops::grouped_ffn_bwd(&e, dt, kernels_act, xb.addr(), pb.addr(), &addrs, &counts, &saved, d, f).unwrap();
                close(&format!("{what} rows gradient"), &g[0], &tensor(&gr.dx, dt, &[r, d]), tol);
                let (dw1, db1) = (tensor(&gr.dw1, acc, &[counts.len(), d, f1]), tensor(&gr.db1, acc, &[counts.len(), f1]));
                let (dw2, db2) = (tensor(&gr.dw2, acc, &[counts.len(), f, d]), tensor(&gr.db2, acc, &[counts.len(), d]));
                for ex in 0..counts.len() {
                    for (k, got) in [&dw1, &db1, &dw2, &db2].into_iter().enumerate() {
                        close(&format!("{what} expert {ex} weight {k}"), &g[1 + 4 * ex + k], &got.get(ex).unwrap(), tol);
                    }
                }
                // Experts without biases (Mixtral's): null bias addresses add nothing, as zero
                // biases would.
                let unbiased: Vec<ops::ExpertAddrs> = addrs.iter().map(|a| ops::ExpertAddrs { b1: 0, b2: 0, ..*a }).collect();
                let (yb, _) = ops::grouped_ffn_fwd(&e, dt, kernels_act, xb.addr(), &unbiased, &counts, d, f).unwrap();
                let zeros: Vec<[HostBuffer; 2]> = weights
                    .iter()
                    .map(|w| [HostBuffer::from_f64(acc, &vec![0.0; w[1].elem_count()]), HostBuffer::from_f64(acc, &vec![0.0; d])])
                    .collect();
                let zeroed: Vec<ops::ExpertAddrs> =
                    addrs.iter().zip(&zeros).map(|(a, z)| ops::ExpertAddrs { b1: z[0].addr(), b2: z[1].addr(), ..*a }).collect();
                let (want, _) = ops::grouped_ffn_fwd(&e, dt, kernels_act, xb.addr(), &zeroed, &counts, d, f).unwrap();
                assert_eq!(yb.to_f64(dt), want.to_f64(dt), "{what}: null biases are zero biases");
            }
        }
    }
}

#[test]
fn linear_forward_and_gradients_with_and_without_bias() {
    for (n, din, dout) in [(37, 24, 19), (0, 5, 3)] {
        let mut var = testing::vars(17, 0.7);
        let (x, w, b, probe) = (var(&[n, din]), var(&[din, dout]), var(&[dout]), var(&[n, dout]));
        let (y, g) = reference(&[x.clone(), w.clone(), b.clone()], probe.as_tensor(), |t| super::linear(&t[0], &t[1], &t[2]).unwrap());
        for e in ORDERS {
            // (x's type, y's type): f64, f32, bf16 products into bf16 and into f32.
            for (x_dt, y_dt, tol) in [
                (Dtype::F64, Dtype::F64, 1e-10),
                (Dtype::F32, Dtype::F32, 2e-5),
                (Dtype::Bf16, Dtype::Bf16, 3e-2),
                (Dtype::Bf16, Dtype::F32, 3e-2),
            ] {
                let acc = x_dt.acc();
                let (xb, wb, bb, pb) =
                    (buf(x.as_tensor(), x_dt), buf(w.as_tensor(), x_dt), buf(b.as_tensor(), acc), buf(probe.as_tensor(), y_dt));
                let what = format!("linear {x_dt:?}→{y_dt:?} n{n}");
                let yb = ops::linear_fwd(&e, x_dt, y_dt, xb.addr(), wb.addr(), bb.addr(), n, din, dout).unwrap();
                close(&format!("{what} forward"), &y, &tensor(&yb, y_dt, &[n, dout]), tol);
                let gr = ops::linear_bwd(&e, x_dt, y_dt, xb.addr(), wb.addr(), pb.addr(), true, n, din, dout).unwrap();
                close(&format!("{what} dx"), &g[0], &tensor(&gr.dx, x_dt, &[n, din]), tol);
                close(&format!("{what} dw"), &g[1], &tensor(&gr.dw, acc, &[din, dout]), tol);
                close(&format!("{what} db"), &g[2], &tensor(gr.db.as_ref().unwrap(), acc, &[dout]), tol);
                let nb = ops::linear_fwd(&e, x_dt, y_dt, xb.addr(), wb.addr(), 0, n, din, dout).unwrap();
                let no_bias = (&y - b.as_tensor().broadcast_as((n, dout)).unwrap()).unwrap();
                close(&format!("{what} forward without bias"), &no_bias, &tensor(&nb, y_dt, &[n, dout]), tol);
            }
        }
    }
}

/// The gradient norm's sums of squares in two passes (parts, then each tensor's parts in order)
/// against f64 sums on the host: tensors of one part, of many with a partial last one, and empty.
#[test]
fn sums_of_squares_in_parts_are_the_host_sums() {
    let sizes = [5usize, lazarus_kernels::SQUARES_PART * 3 + 17, 0, 1000];
    let data: Vec<HostBuffer> =
        sizes.iter().enumerate().map(|(i, &n)| HostBuffer::from_f64(Dtype::F32, &testing::data(n, 30 + i as u64))).collect();
    for e in ORDERS {
        let list: Vec<(u64, usize)> = data.iter().zip(&sizes).map(|(b, &n)| (b.addr(), n)).collect();
        let out = ops::sum_squares(&e, &list).unwrap().to_f64(Dtype::F64);
        for ((b, &n), got) in data.iter().zip(&sizes).zip(&out) {
            let want: f64 = b.to_f64(Dtype::F32)[..n].iter().map(|x| x * x).sum();
            assert!((got - want).abs() <= 1e-12 * want.max(1.0), "{n} elements: {got} vs {want}");
        }
    }
}

/// The parts' kernel with fewer blocks than parts (a model of over 2³² elements): each block
/// strides over the parts, every part written once.
#[test]
fn sums_of_squares_parts_stride_when_the_grid_is_smaller() {
    let sizes = [lazarus_kernels::SQUARES_PART * 2 + 3, 7, lazarus_kernels::SQUARES_PART];
    let data: Vec<HostBuffer> =
        sizes.iter().enumerate().map(|(i, &n)| HostBuffer::from_f64(Dtype::F32, &testing::data(n, 60 + i as u64))).collect();
    let counts: Vec<usize> = sizes.iter().map(|&n| lazarus_kernels::squares_parts(n)).collect();
    let mut starts = vec![0u32];
    for c in &counts {
        starts.push(starts.last().unwrap() + *c as u32);
    }
    let total = *starts.last().unwrap() as usize;
    let e = ORDERS[0];
    let addrs = e.upload_u64(&data.iter().map(|b| b.addr()).collect::<Vec<_>>()).unwrap();
    let lens = e.upload_u64(&sizes.iter().map(|&n| n as u64).collect::<Vec<_>>()).unwrap();
    let st = e.upload_u32(&starts).unwrap();
    let parts = HostBuffer::from_f64(Dtype::F64, &vec![f64::NAN; total]);
    let mut l = lazarus_kernels::sum_squares_parts(addrs.addr(), lens.addr(), st.addr(), sizes.len(), total, parts.addr());
    l.grid = [2, 1, 1];
    // SAFETY: the tensors, their lengths and starts as the kernel reads them; parts has total slots.
    unsafe { e.launch(&l).unwrap() };
    let got = parts.to_f64(Dtype::F64);
    let mut p = 0;
    for (b, &n) in data.iter().zip(&sizes) {
        let x = b.to_f64(Dtype::F32);
        for lo in (0..n.max(1)).step_by(lazarus_kernels::SQUARES_PART) {
            let want: f64 = x[lo..(lo + lazarus_kernels::SQUARES_PART).min(n)].iter().map(|v| v * v).sum();
            assert!((got[p] - want).abs() <= 1e-12 * want.max(1.0), "part {p}: {} vs {want}", got[p]);
            p += 1;
        }
    }
    assert_eq!(p, total);
}

/// AdamW's kernel against the CPU pass, with the bf16 working copy it refreshes.
#[test]
fn adamw_kernel_is_the_cpu_pass_and_refreshes_the_working_copy() {
    let n = 3000;
    let e = ORDERS[0];
    let p: Vec<f64> = testing::data(n, 1);
    let g: Vec<f64> = testing::data(n, 2);
    let (pb, gb) = (HostBuffer::from_f64(Dtype::F32, &p), HostBuffer::from_f64(Dtype::F32, &g));
    let (mb, vb) = (HostBuffer::from_f64(Dtype::F32, &vec![0.1; n]), HostBuffer::from_f64(Dtype::F32, &vec![0.2; n]));
    let copy = e.alloc(Dtype::Bf16.into(), n).unwrap();
    let k = [0.9f32, 0.95, 0.7, 1e-2, 1.3, 1e-8, 0.999];
    // SAFETY: five buffers of n elements.
    unsafe { e.launch(&lazarus_kernels::adamw(pb.addr(), gb.addr(), mb.addr(), vb.addr(), copy.addr(), n, k)).unwrap() };
    let new = pb.to_f64(Dtype::F32);
    let mut want = (p.iter().map(|&x| x as f32).collect::<Vec<_>>(), vec![0.1f32; n], vec![0.2f32; n]);
    for i in 0..n {
        let gi = g[i] as f32 * k[2];
        want.1[i] = k[0] * want.1[i] + (1.0 - k[0]) * gi;
        want.2[i] = k[1] * want.2[i] + (1.0 - k[1]) * gi * gi;
        want.0[i] = want.0[i] * k[6] - k[3] * want.1[i] / (want.2[i].sqrt() * k[4] + k[5]);
    }
    assert!(new.iter().zip(&want.0).all(|(a, &b)| *a as f32 == b), "the parameter is the CPU pass's, bit for bit");
    let c = copy.to_f64(Dtype::Bf16);
    assert!(c.iter().zip(&new).all(|(c, p)| (*c - *p).abs() <= p.abs() / 256.0 + 1e-30), "the working copy is the new parameter in bf16");
}

/// AdamW over a list of tensors in one launch against the single-tensor kernel, bit for bit:
/// tensors of one part, of several with a partial last one, empty, of one element; with and
/// without working copies and with different coefficients each; and with fewer blocks than parts.
#[test]
fn adamw_over_a_list_is_the_single_tensor_kernel_bit_for_bit() {
    let sizes = [3000usize, lazarus_kernels::ADAMW_PART * 2 + 5, 0, 1, 700];
    let e = ORDERS[0];
    // Per tensor: p, g, m, v (f32) and a bf16 copy for the even-numbered ones.
    let make = |seed: u64| -> Vec<(Vec<HostBuffer>, Option<HostBuffer>)> {
        sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                let s = seed + 10 * i as u64;
                let bufs = (0..4)
                    .map(|j| {
                        HostBuffer::from_f64(
                            Dtype::F32,
                            &testing::data(n, s + j).iter().map(|x| x.abs() * 0.1 + if j == 3 { 0.01 } else { 0.0 }).collect::<Vec<_>>(),
                        )
                    })
                    .collect();
                let copy = (i % 2 == 0).then(|| e.alloc(Dtype::Bf16.into(), n).unwrap());
                (bufs, copy)
            })
            .collect()
    };
    let coeffs = |i: usize| -> lazarus_kernels::AdamWScalars {
        [0.9, 0.95, 0.7 + 0.01 * i as f32, 1e-2, 1.3, 1e-8, if i == 1 { 1.0 } else { 0.999 }]
    };
    let list = |set: &[(Vec<HostBuffer>, Option<HostBuffer>)]| -> Vec<lazarus_kernels::AdamWTensor> {
        set.iter()
            .zip(&sizes)
            .enumerate()
            .map(|(i, ((b, c), &n))| lazarus_kernels::AdamWTensor {
                p: b[0].addr(),
                g: b[1].addr(),
                m: b[2].addr(),
                v: b[3].addr(),
                copy: c.as_ref().map_or(0, |c| c.addr()),
                n,
                k: coeffs(i),
            })
            .collect()
    };
    let bits = |set: &[(Vec<HostBuffer>, Option<HostBuffer>)]| -> Vec<Vec<u64>> {
        set.iter()
            .flat_map(|(b, c)| {
                let mut out: Vec<Vec<u64>> =
                    [0, 2, 3].iter().map(|&j| b[j].to_f64(Dtype::F32).iter().map(|x| x.to_bits()).collect()).collect();
                if let Some(c) = c {
                    out.push(c.to_f64(Dtype::Bf16).iter().map(|x| x.to_bits()).collect());
                }
                out
            })
            .collect()
    };
    // The single-tensor kernel, tensor by tensor.
    let single = make(100);
    for t in list(&single) {
        if t.n > 0 {
            // SAFETY: each buffer holds n elements of its type.
            unsafe { e.launch(&lazarus_kernels::adamw(t.p, t.g, t.m, t.v, t.copy, t.n, t.k)).unwrap() };
        }
    }
    // One launch over the list.
    let all = make(100);
    // SAFETY: as above; the tensors are distinct buffers.
    unsafe { ops::adamw_all(&e, &list(&all)).unwrap() };
    assert_eq!(bits(&single), bits(&all), "one launch over the list is the per-tensor kernel");
    // Two blocks striding over every part.
    let strided = make(100);
    let table = lazarus_kernels::adamw_table(&list(&strided));
    let parts = table[sizes.len()] as usize;
    // Parts of 2^16 elements: 1, 3, none for the empty tensor, 1, 1.
    assert_eq!(parts, 6, "a part per 2^16 elements, none for an empty tensor");
    let on_device = e.upload_u64(&table).unwrap();
    let mut l = lazarus_kernels::adamw_list(on_device.addr(), sizes.len(), parts).unwrap();
    l.grid = [2, 1, 1];
    // SAFETY: the table of the tensors above.
    unsafe { e.launch(&l).unwrap() };
    assert_eq!(bits(&single), bits(&strided), "blocks striding over the parts");
    // An untouched run differs: the comparison sees the update.
    assert_ne!(bits(&single), bits(&make(100)));
}
