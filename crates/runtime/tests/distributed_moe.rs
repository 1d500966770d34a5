//! A distributed MoE layer on 1–4 ranks (loopback TCP, one thread per rank) with uneven replica
//! placements computes the same outputs and gradients as the single-process layer.

use std::collections::BTreeMap;
use std::time::Duration;

use candle_core::{DType, Device, Tensor, Var};
use lazarus_comm::{Group, LocalTransport, TcpTransport, Transport};
use lazarus_model::config::Activation;
use lazarus_model::ops::{expert_ffn, softmax_last};
use lazarus_model::rng::SplitMix64;
use lazarus_model::routing::top_k;
use lazarus_runtime::{DispatchMode, DistributedMoe, ExpertWeights, DEFAULT_BUCKET_BYTES};

const D: usize = 16;
const F: usize = 12;
const E: usize = 4;
const K: usize = 2;
const N: usize = 30;

struct Weights {
    gate: Vec<f32>,
    experts: Vec<[Vec<f32>; 4]>,
    h: Vec<f32>,
    probe: Vec<f32>,
}

fn weights() -> Weights {
    let mut r = SplitMix64::new(21);
    let mut v = |n: usize, s: f64| (0..n).map(|_| (r.normal() * s) as f32).collect::<Vec<f32>>();
    Weights {
        gate: v(D * E, 0.8),
        experts: (0..E).map(|_| [v(D * F, 0.4), v(F, 0.1), v(F * D, 0.4), v(D, 0.1)]).collect(),
        h: v(N * D, 1.0),
        probe: v(N * D, 1.0),
    }
}

fn var(data: &[f32], shape: &[usize]) -> Var {
    Var::from_tensor(&Tensor::from_vec(data.to_vec(), shape, &Device::Cpu).unwrap()).unwrap()
}

fn expert_vars(w: &[Vec<f32>; 4]) -> ExpertWeights {
    ExpertWeights::new(vec![var(&w[0], &[D, F]), var(&w[1], &[F]), var(&w[2], &[F, D]), var(&w[3], &[D])], Activation::Gelu).unwrap()
}

/// (output [N·D], dh [N·D], gate grad, expert grads) of the single-process layer.
type Reference = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<[Vec<f32>; 4]>);

fn reference(w: &Weights) -> Reference {
    let h = var(&w.h, &[N, D]);
    let gate = var(&w.gate, &[D, E]);
    let experts: Vec<ExpertWeights> = w.experts.iter().map(expert_vars).collect();
    let probs = softmax_last(&h.as_tensor().matmul(gate.as_tensor()).unwrap()).unwrap();
    let host: Vec<Vec<f64>> = probs.to_dtype(DType::F64).unwrap().to_vec2().unwrap();
    let choices: Vec<u32> = host.iter().flat_map(|row| top_k(row, K)).map(|c| c as u32).collect();
    let mut slots = Tensor::zeros((N * K, D), DType::F32, &Device::Cpu).unwrap();
    for e in 0..E {
        let idx: Vec<u32> = (0..N * K).filter(|&s| choices[s] as usize == e).map(|s| s as u32).collect();
        if idx.is_empty() {
            continue;
        }
        let toks: Vec<u32> = idx.iter().map(|&s| s / K as u32).collect();
        let rows = h.as_tensor().index_select(&Tensor::new(toks.as_slice(), &Device::Cpu).unwrap(), 0).unwrap();
        let ex = &experts[e];
        let v = ex.vars();
        let y = expert_ffn(&rows, v[0].as_tensor(), v[1].as_tensor(), v[2].as_tensor(), v[3].as_tensor(), Activation::Gelu).unwrap();
        slots = slots.index_add(&Tensor::new(idx.as_slice(), &Device::Cpu).unwrap(), &y, 0).unwrap();
    }
    let idx = Tensor::from_vec(choices, (N, K), &Device::Cpu).unwrap();
    let wt = probs.gather(&idx, 1).unwrap();
    let wt = wt.broadcast_div(&wt.sum_keepdim(1).unwrap()).unwrap();
    let out = slots.reshape((N, K, D)).unwrap().broadcast_mul(&wt.unsqueeze(2).unwrap()).unwrap().sum(1).unwrap();
    let probe = Tensor::from_vec(w.probe.clone(), (N, D), &Device::Cpu).unwrap();
    let grads = (&out * &probe).unwrap().sum_all().unwrap().backward().unwrap();
    let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let eg = experts
        .iter()
        .map(|ex| {
            let g = |v: &Var| grads.get(v.as_tensor()).map(flat).unwrap_or_else(|| vec![0.0; v.elem_count()]);
            {
                let v = ex.vars();
                [g(&v[0]), g(&v[1]), g(&v[2]), g(&v[3])]
            }
        })
        .collect();
    (flat(&out), flat(grads.get(h.as_tensor()).unwrap()), flat(grads.get(gate.as_tensor()).unwrap()), eg)
}

fn close(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= 1e-5 + 1e-4 * y.abs(), "{what}[{i}]: {x} vs {y}");
    }
}

/// Runs rank `rank` of `ranks`, checks it against the reference, returns its forward wire bytes.
fn run_rank(
    rank: usize,
    ranks: usize,
    t: &mut dyn Transport,
    replicas: &[Vec<u32>],
    w: &Weights,
    mode: DispatchMode,
    bucket_bytes: usize,
) -> (u64, u64, u64) {
    let (out_ref, dh_ref, gate_ref, experts_ref) = reference(w);
    let lo = rank * N / ranks;
    let hi = (rank + 1) * N / ranks;
    let mut experts = BTreeMap::new();
    for (e, r) in replicas.iter().enumerate() {
        if r[rank] > 0 {
            experts.insert(e, expert_vars(&w.experts[e]));
        }
    }
    let moe = DistributedMoe {
        gate: var(&w.gate, &[D, E]),
        route_bias: None,
        experts,
        replicas: replicas.to_vec(),
        top_k: K,
        router: lazarus_model::routing::Router::default(),
        timeout: Duration::from_secs(20),
        mode,
        bucket_bytes,
        catching_up: Vec::new(),
    };
    let mut world = Group::world(ranks);
    let h = var(&w.h[lo * D..hi * D], &[hi - lo, D]);
    let fwd = moe.forward(t, &mut world, h.as_tensor()).unwrap();
    close(&fwd.output.flatten_all().unwrap().to_vec1::<f32>().unwrap(), &out_ref[lo * D..hi * D], "output");
    let probe = Tensor::from_vec(w.probe[lo * D..hi * D].to_vec(), (hi - lo, D), &Device::Cpu).unwrap();
    let grads = moe.backward(t, &mut world, &fwd, &probe).unwrap();
    let router_dh = grads.router.get(h.as_tensor()).unwrap();
    let dh = (&grads.h_through_experts + router_dh).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    close(&dh, &dh_ref[lo * D..hi * D], "dh");
    close(&grads.gate.flatten_all().unwrap().to_vec1::<f32>().unwrap(), &gate_ref, "gate grad");
    for (e, g) in &grads.experts {
        for (i, t) in g.iter().enumerate() {
            close(&t.flatten_all().unwrap().to_vec1::<f32>().unwrap(), &experts_ref[*e][i], &format!("expert {e} grad {i}"));
        }
    }
    (fwd.wire_bytes, fwd.expert_rows, grads.wire_bytes)
}

/// Total forward wire bytes over all ranks.
fn check(ranks: usize, replicas: Vec<Vec<u32>>) -> u64 {
    check_mode(ranks, replicas, DispatchMode::Flexible)
}

fn check_mode(ranks: usize, replicas: Vec<Vec<u32>>, mode: DispatchMode) -> u64 {
    check_mode_rows(ranks, replicas, mode).0
}

fn check_mode_rows(ranks: usize, replicas: Vec<Vec<u32>>, mode: DispatchMode) -> (u64, u64) {
    check_buckets(ranks, replicas, mode, DEFAULT_BUCKET_BYTES)
}

/// (forward wire bytes, rows computed by experts), summed over the ranks.
fn check_buckets(ranks: usize, replicas: Vec<Vec<u32>>, mode: DispatchMode, bucket_bytes: usize) -> (u64, u64) {
    let w = std::sync::Arc::new(weights());
    if ranks == 1 {
        let mut t = LocalTransport::new(1);
        let (sent, rows, _) = run_rank(0, 1, &mut t, &replicas, &w, mode, bucket_bytes);
        return (sent, rows);
    }
    let group = TcpTransport::local_group(ranks, 1).unwrap();
    let handles: Vec<_> = group
        .into_iter()
        .enumerate()
        .map(|(rank, mut t)| {
            let (w, replicas) = (w.clone(), replicas.clone());
            std::thread::spawn(move || run_rank(rank, ranks, &mut t, &replicas, &w, mode, bucket_bytes))
        })
        .collect();
    let (forward, rows, backward) =
        handles.into_iter().map(|h| h.join().expect("rank failed")).fold((0, 0, 0), |a, b| (a.0 + b.0, a.1 + b.1, a.2 + b.2));
    // The backward moves as many bytes as the forward where rows go per slot; where a token
    // went once to a rank, the index and weights are not resent and the combine weights'
    // gradients (one per slot) come back instead: 4 + 4 · slots fewer.
    assert!(backward <= forward, "forward {forward} backward {backward}");
    (forward, rows)
}

#[test]
fn one_rank_matches_the_reference() {
    assert_eq!(check(1, vec![vec![1]; E]), 0, "nothing crosses the wire with one rank");
}

/// The static expert-parallel baseline computes the same layer, but pads every buffer; the
/// flexible dispatcher sends exactly the rows whose expert lives elsewhere.
#[test]
fn static_padded_baseline_is_equivalent_and_sends_more() {
    let one_each: Vec<Vec<u32>> = (0..E).map(|e| (0..4).map(|r| u32::from(r == e)).collect()).collect();
    let flexible = check_mode(4, one_each.clone(), DispatchMode::Flexible);
    let (padded, padded_rows) = check_mode_rows(4, one_each.clone(), DispatchMode::StaticPadded);
    let (skip, skip_rows) = check_mode_rows(4, one_each, DispatchMode::StaticSkipPadding);
    assert_eq!(skip, padded, "computing the padding or not, the same rows travel");
    // Skipping padding computes each routed slot once; DeepSpeed's way computes the capacity
    // buffer: every expert × every source rank × C rows.
    assert_eq!(skip_rows, (N * K) as u64);
    assert!(padded_rows > skip_rows && padded_rows % (E as u64 * 4) == 0, "{padded_rows} vs {skip_rows}");
    // Minimum: every slot whose expert is on another rank, there and back, d f32 values each.
    let w = weights();
    let h = Tensor::from_vec(w.h.clone(), (N, D), &Device::Cpu).unwrap();
    let gate = Tensor::from_vec(w.gate.clone(), (D, E), &Device::Cpu).unwrap();
    let probs: Vec<Vec<f64>> = softmax_last(&h.matmul(&gate).unwrap()).unwrap().to_dtype(DType::F64).unwrap().to_vec2().unwrap();
    let remote: usize = probs
        .iter()
        .enumerate()
        .map(|(tok, row)| {
            // The rank holding token `tok` under the contiguous split of run_rank.
            let rank = (0..4).rev().find(|&r| r * N / 4 <= tok).unwrap();
            top_k(row, K).into_iter().filter(|&e| e != rank).count()
        })
        .sum();
    assert_eq!(flexible, (2 * remote * D * 4) as u64);
    assert!(padded > flexible, "padded {padded} vs flexible {flexible}");
}

/// A token whose two choices are experts of the same other rank goes there once (with an index
/// and a combine weight per slot) when that is smaller than a row per slot, and comes back once
/// (the holder's Σ w · y): the forward's bytes are exactly that rule's, computed here from the
/// reference routing, and the layer — output, d h, the gate's and experts' gradients — still
/// matches the single-process reference.
#[test]
fn a_token_goes_once_to_each_rank_its_choices_are_on() {
    // Expert 0 on rank 0, experts 1, 2 and 3 on rank 1: rank 0's tokens often have both
    // choices on rank 1; rank 1's can have only one on rank 0 (their buffer stays in place).
    let placement = vec![vec![1, 0], vec![0, 1], vec![0, 1], vec![0, 1]];
    let holder = |e: usize| usize::from(e > 0);
    let sent = check(2, placement);
    let w = weights();
    let h = Tensor::from_vec(w.h.clone(), (N, D), &Device::Cpu).unwrap();
    let gate = Tensor::from_vec(w.gate.clone(), (D, E), &Device::Cpu).unwrap();
    let probs: Vec<Vec<f64>> = softmax_last(&h.matmul(&gate).unwrap()).unwrap().to_dtype(DType::F64).unwrap().to_vec2().unwrap();
    // Per source rank: slots and distinct tokens bound for the other rank.
    let (mut slots, mut distinct) = ([0usize; 2], [0usize; 2]);
    for (tok, row) in probs.iter().enumerate() {
        let rank = usize::from(tok >= N / 2);
        let away = top_k(row, K).into_iter().filter(|&e| holder(e) != rank).count();
        slots[rank] += away;
        distinct[rank] += usize::from(away > 0);
    }
    let per_slot = |s: usize| 4 * s * D;
    let forward = |s: usize, u: usize| match 4 + 8 * s + 4 * u * D < per_slot(s) {
        true => 4 + 8 * s + 4 * u * D + 4 * u * D,
        false => 2 * per_slot(s),
    };
    let expected: usize = (0..2).map(|r| forward(slots[r], distinct[r])).sum();
    assert_eq!(sent, expected as u64);
    assert!(forward(slots[0], distinct[0]) < 2 * per_slot(slots[0]), "rank 0's tokens go once: {slots:?} {distinct:?}");
    assert_eq!(forward(slots[1], distinct[1]), 2 * per_slot(slots[1]), "rank 1's rows stay in place: {slots:?} {distinct:?}");
    assert!(sent < 2 * per_slot(slots[0] + slots[1]) as u64, "{sent}");
}

#[test]
fn static_mode_rejects_replicated_experts() {
    let w = weights();
    let mut t = LocalTransport::new(1);
    let moe = DistributedMoe {
        gate: var(&w.gate, &[D, E]),
        route_bias: None,
        experts: (0..E).map(|e| (e, expert_vars(&w.experts[e]))).collect(),
        replicas: vec![vec![2]; E],
        top_k: K,
        router: lazarus_model::routing::Router::default(),
        timeout: Duration::from_secs(5),
        mode: DispatchMode::StaticPadded,
        bucket_bytes: DEFAULT_BUCKET_BYTES,
        catching_up: Vec::new(),
    };
    let h = var(&w.h, &[N, D]);
    let err = moe.forward(&mut t, &mut Group::world(1), h.as_tensor()).err().expect("must fail").to_string();
    assert!(err.contains("one replica"), "{err}");
}

#[test]
fn two_ranks_with_a_hot_expert_replicated() {
    // Expert 3 has three replicas (two on rank 1), the others one each.
    check(2, vec![vec![1, 0], vec![0, 1], vec![1, 0], vec![1, 2]]);
}

#[test]
fn three_ranks_uneven() {
    check(3, vec![vec![1, 0, 1], vec![0, 2, 0], vec![1, 1, 0], vec![0, 0, 1]]);
}

#[test]
fn four_ranks_every_expert_everywhere_unevenly() {
    check(4, vec![vec![1, 1, 0, 1], vec![0, 1, 1, 1], vec![2, 0, 1, 0], vec![1, 1, 1, 3]]);
}

#[test]
fn one_expert_per_bucket_matches_too() {
    // Every expert on ranks 0 and 1, three on rank 2: each holder set has several experts, so
    // a 1-byte cap splits every bucket into single experts all-reduced one after another while
    // the next is computed. Same gradients as one bucket per holder set.
    let replicas = vec![vec![1, 1, 1], vec![1, 1, 0], vec![1, 1, 1], vec![1, 1, 1]];
    check_buckets(3, replicas.clone(), DispatchMode::Balanced, 1);
    check_buckets(3, replicas, DispatchMode::Flexible, DEFAULT_BUCKET_BYTES);
}
