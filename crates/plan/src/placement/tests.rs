use super::gpus::{gpu_lambda, refine_gpus};
use super::guard::{guarded_nodes, node_imbalance};
use super::Strategy;
use super::*;
use crate::rng::SplitMix64;
use proptest::prelude::{any, prop_assert, prop_assert_eq, prop_assume, proptest, ProptestConfig};

fn random_replicas(rng: &mut SplitMix64, experts: usize, total: usize) -> Vec<usize> {
    let mut r = vec![1usize; experts];
    for _ in experts..total {
        // Skewed: later experts are more likely to get extra replicas.
        let e = rng.below(experts).max(rng.below(experts));
        r[e] += 1;
    }
    r
}

#[test]
fn mro_builds_the_theorem_1_groups() {
    // Figure 4: 4 experts, 5 nodes x 4 slots, replicas [2,5,6,7]; E ≤ c so one group on the
    // first 2 nodes, leftovers spread.
    let shape = ClusterShape::new(5, 1, 4).unwrap();
    let p = place(&[2, 5, 6, 7], shape, Strategy::Mro, None).unwrap();
    assert_eq!(p.nodes()[0], vec![0, 1, 2, 3]);
    assert_eq!(p.nodes()[1], vec![0, 1, 2, 3]);
    assert!(p.nodes()[2..].iter().all(|n| !n.contains(&0)));
}

/// λ* from the graph a placement keeps is the λ* of its slots: the same for its clones (which
/// share the graph), for a copy read back from JSON (which makes its own), and for the loads of
/// every later epoch; the graph is not part of equality or of what is written.
#[test]
fn a_placements_kept_graph_gives_the_lambda_of_its_slots() {
    let mut rng = SplitMix64::new(7);
    let shape = ClusterShape::new(6, 4, 3).unwrap();
    let replicas = random_replicas(&mut rng, 20, shape.total_slots());
    let p = place(&replicas, shape, Strategy::Lazarus, None).unwrap();
    let json = serde_json::to_string(&p).unwrap();
    let twin = p.clone();
    for epoch in 0..5 {
        let loads: Vec<f64> = (0..20).map(|_| rng.below(1000) as f64).collect();
        let fresh = crate::balance::min_max_load_of_pairs(&gpus::gpu_pairs(p.nodes(), shape), &loads, shape.ranks()).unwrap();
        assert_eq!(p.load_balance(&loads).unwrap(), fresh, "epoch {epoch}");
        assert_eq!(twin.load_balance(&loads).unwrap(), fresh, "a clone, epoch {epoch}");
        let read: Placement = serde_json::from_str(&json).unwrap();
        assert_eq!(read, p);
        assert_eq!(read.load_balance(&loads).unwrap(), fresh, "read back, epoch {epoch}");
    }
    assert_eq!(serde_json::to_string(&p).unwrap(), json, "the graph made is not written");
}

#[test]
fn non_finite_or_negative_loads_are_an_error() {
    let shape = ClusterShape::new(1, 2, 2).unwrap();
    for bad in [f64::NAN, f64::INFINITY, -1.0] {
        let e = place(&[2, 2], shape, Strategy::Compact, Some(&[1.0, bad])).unwrap_err().to_string();
        assert!(e.contains("expert 1"), "{e}");
    }
}

#[test]
fn strategy_names_round_trip_and_unknown_is_an_error() {
    for s in Strategy::ALL {
        assert_eq!(s.name().parse::<Strategy>().unwrap(), s);
    }
    let err = "best".parse::<Strategy>().unwrap_err().to_string();
    assert!(err.contains("strategy") && err.contains("best"), "{err}");
}

#[test]
fn bad_shapes_and_replicas_are_rejected() {
    assert!(ClusterShape::new(0, 1, 1).unwrap_err().to_string().contains("nodes"));
    assert!(ClusterShape::new(1, 1, 0).unwrap_err().to_string().contains("slots"));
    let shape = ClusterShape::new(2, 1, 2).unwrap();
    assert_eq!(place(&[1, 2], shape, Strategy::Lazarus, None).unwrap_err(), PlanError::SlotMismatch { sum: 3, slots: 4 });
    assert!(place(&[0, 4], shape, Strategy::Mro, None).unwrap_err().to_string().contains("expert 0"));
    assert!(Placement::from_nodes(shape, 2, vec![vec![0, 0], vec![0, 0]]).unwrap_err().to_string().contains("expert 1"));
    assert!(Placement::from_nodes(shape, 2, vec![vec![0, 1], vec![0]]).is_err());
    assert!(Placement::from_nodes(shape, 2, vec![vec![0, 1], vec![0, 7]]).is_err());
}

#[test]
fn gpus_are_balanced_on_expected_tokens() {
    // One node, 2 GPUs x 2 slots; expert 0 is hot.
    let shape = ClusterShape::new(1, 2, 2).unwrap();
    let loads = [100.0, 10.0, 10.0, 10.0];
    let p = place(&[1, 1, 1, 1], shape, Strategy::Compact, Some(&loads)).unwrap();
    let gpu_load = |g: usize| p.gpu(0, g).iter().map(|&e| loads[e]).sum::<f64>();
    // Two slots per GPU: the best split is {hot, cold} vs {cold, cold}.
    assert_eq!((gpu_load(0) - gpu_load(1)).abs(), 90.0);
    assert!(p.gpu(0, 0).contains(&0) != p.gpu(0, 1).contains(&0));
    let r = p.rank_replicas();
    assert_eq!(r.len(), 4);
    assert_eq!(r.iter().map(|v| v.iter().sum::<u32>()).sum::<u32>(), 4);
}

/// Each node's experts, sorted: what failures see of a placement.
fn node_multisets(nodes: &[Vec<ExpertId>]) -> Vec<Vec<ExpertId>> {
    nodes
        .iter()
        .map(|n| {
            let mut n = n.clone();
            n.sort_unstable();
            n
        })
        .collect()
}

#[test]
fn the_guard_gives_every_worker_a_hot_replica_at_8_to_1() {
    // The bench's shape: 4 workers x 4 slots, every token on expert 0.
    let shape = ClusterShape::new(4, 1, 4).unwrap();
    let loads = [8.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0];
    let r = [9, 1, 1, 1, 1, 1, 1, 1];
    let plain = place(&r, shape, Strategy::Lazarus, Some(&loads)).unwrap();
    assert!((plain.load_balance(&loads).unwrap().imbalance() - 4.0 / 3.0).abs() < 1e-9);
    let ours = place_balanced(&r, shape, &loads, DEFAULT_MAX_IMBALANCE).unwrap();
    assert!(ours.nodes().iter().all(|n| n.contains(&0)), "{:?}", ours.nodes());
    assert!((ours.load_balance(&loads).unwrap().imbalance() - 1.0).abs() < 1e-9);
    // The price: one survivable single failure of four instead of two.
    let p1 = |p: &Placement| recovery_curve(p)[1].probability;
    assert!((p1(&plain) - 0.5).abs() < 1e-12 && (p1(&ours) - 0.25).abs() < 1e-12);
    // A loose guard keeps the fault-tolerant optimum.
    assert_eq!(place_balanced(&r, shape, &loads, 1.5).unwrap(), plain);
    for bad in [0.99, f64::NAN, f64::INFINITY] {
        let e = place_balanced(&r, shape, &loads, bad).unwrap_err().to_string();
        assert!(e.contains("max_imbalance"), "{e}");
    }
    assert!(place_balanced(&r, shape, &loads[..3], 1.05).unwrap_err().to_string().contains("loads"));
}

/// Every way to split one node's slots over its GPUs (as sorted GPU lists; repeats kept).
fn arrangements(node: &[ExpertId], g: usize, c: usize) -> Vec<Vec<ExpertId>> {
    let mut out: Vec<Vec<ExpertId>> = Vec::new();
    let mut perm: Vec<ExpertId> = node.to_vec();
    perm.sort_unstable();
    // Heap's algorithm over slot orders; canonical form: each GPU sorted, GPUs sorted.
    let k = perm.len();
    let mut stack = vec![0usize; k];
    let mut push = |p: &[ExpertId]| {
        let mut gpus: Vec<Vec<ExpertId>> = p
            .chunks(c)
            .map(|x| {
                let mut x = x.to_vec();
                x.sort_unstable();
                x
            })
            .collect();
        gpus.sort();
        let flat: Vec<ExpertId> = gpus.concat();
        if !out.contains(&flat) {
            out.push(flat);
        }
    };
    push(&perm);
    let mut i = 0;
    while i < k {
        if stack[i] < i {
            if i % 2 == 0 {
                perm.swap(0, i)
            } else {
                perm.swap(stack[i], i)
            }
            push(&perm);
            stack[i] += 1;
            i = 0;
        } else {
            stack[i] = 0;
            i += 1;
        }
    }
    assert!(out.iter().all(|x| x.len() == g * c));
    out
}

#[test]
fn refined_gpus_against_every_arrangement_of_small_nodes() {
    // Oracle: every within-node arrangement of the guarded plan's nodes, the least per-GPU λ*.
    let (mut cases, mut lpt_best, mut refined_best, mut improved) = (0, 0, 0, 0);
    let mut rng = SplitMix64::new(11);
    for (n, g, c) in [(2, 2, 2), (3, 2, 2), (2, 2, 3), (2, 3, 2), (3, 3, 2)] {
        let shape = ClusterShape::new(n, g, c).unwrap();
        for _ in 0..40 {
            let experts = 2 + rng.below(shape.total_slots() - 1);
            let loads: Vec<f64> =
                (0..experts).map(|_| if rng.below(3) == 0 { 0.0 } else { (1 + rng.below(100) * (1 + rng.below(8))) as f64 }).collect();
            let Ok(alloc) = crate::allocate(&loads, shape.total_slots(), 1) else { continue };
            let r = alloc.replicas;
            let nodes = guarded_nodes(&r, n, shape.slots_per_node(), &loads, DEFAULT_MAX_IMBALANCE);
            let lpt = balance_gpus(nodes.clone(), &r, shape, Some(&loads));
            let refined = place_balanced(&r, shape, &loads, DEFAULT_MAX_IMBALANCE).unwrap().nodes().to_vec();
            let lambda = |nodes: &[Vec<ExpertId>]| gpu_lambda(nodes, shape, &loads);
            let per_node: Vec<Vec<Vec<ExpertId>>> = nodes.iter().map(|x| arrangements(x, g, c)).collect();
            let mut best = f64::INFINITY;
            let mut pick = vec![0usize; n];
            loop {
                let cand: Vec<Vec<ExpertId>> = (0..n).map(|i| per_node[i][pick[i]].clone()).collect();
                best = best.min(lambda(&cand));
                let mut i = 0;
                while i < n && pick[i] + 1 == per_node[i].len() {
                    pick[i] = 0;
                    i += 1;
                }
                if i == n {
                    break;
                }
                pick[i] += 1;
            }
            let (l, f) = (lambda(&lpt), lambda(&refined));
            assert!(f <= l * (1.0 + 1e-9) && f >= best * (1.0 - 1e-9), "{l} {f} {best}");
            cases += 1;
            lpt_best += (l <= best * (1.0 + 1e-9)) as usize;
            refined_best += (f <= best * (1.0 + 1e-9)) as usize;
            improved += (f < l * (1.0 - 1e-9)) as usize;
        }
    }
    // Measured: 200 instances, LPT optimal in 165, refined in 199, better than LPT in 35.
    eprintln!("{cases} instances: LPT optimal in {lpt_best}, refined optimal in {refined_best}, refined better than LPT in {improved}");
    assert!(cases >= 150, "{cases}");
    assert!(refined_best * 100 >= cases * 97, "refined optimal in only {refined_best} of {cases}");
    assert!(improved * 10 >= cases, "LPT was already optimal almost everywhere ({improved} of {cases} improved): the oracle has no teeth");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn the_guard_never_unbalances_and_keeps_what_already_meets_it(
        n in 1usize..40, g in 1usize..3, c in 1usize..6, seed in any::<u64>(),
    ) {
        let shape = ClusterShape::new(n, g, c).unwrap();
        let mut rng = SplitMix64::new(seed);
        let experts = 1 + rng.below(shape.total_slots().min(64));
        // Skewed loads with some cold experts, allocated by Eq. 1 with floor 1.
        let loads: Vec<f64> = (0..experts).map(|_| if rng.below(3) == 0 { 0.0 } else { (rng.below(1000) * rng.below(8)) as f64 }).collect();
        let r = crate::allocate(&loads, shape.total_slots(), 1).unwrap().replicas;
        let plain = place(&r, shape, Strategy::Lazarus, Some(&loads)).unwrap();
        let ours = place_balanced(&r, shape, &loads, DEFAULT_MAX_IMBALANCE).unwrap();
        prop_assert_eq!(ours.replica_counts(), r.clone());
        prop_assert!(Placement::from_nodes(shape, experts, ours.nodes().to_vec()).is_ok());
        let (a, b) = (node_imbalance(ours.nodes(), &loads), node_imbalance(plain.nodes(), &loads));
        prop_assert!(a <= b + 1e-9, "guarded {} > plain {}", a, b);
        if b <= DEFAULT_MAX_IMBALANCE {
            // The same nodes; within them the GPUs may be refined for the flow.
            prop_assert_eq!(node_multisets(ours.nodes()), node_multisets(plain.nodes()));
        }
    }

    #[test]
    fn refining_the_gpus_keeps_every_node_and_never_unbalances_a_gpu(
        n in 1usize..24, g in 2usize..5, c in 1usize..4, seed in any::<u64>(),
    ) {
        let shape = ClusterShape::new(n, g, c).unwrap();
        let mut rng = SplitMix64::new(seed);
        let experts = 1 + rng.below(shape.total_slots().min(48));
        let loads: Vec<f64> = (0..experts).map(|_| if rng.below(3) == 0 { 0.0 } else { (rng.below(1000) * (1 + rng.below(8))) as f64 }).collect();
        let r = crate::allocate(&loads, shape.total_slots(), 1).unwrap().replicas;
        let spread = balance_gpus(lazarus_nodes(&r, n, shape.slots_per_node()), &r, shape, Some(&loads));
        let refined = refine_gpus(spread.clone(), shape, &loads);
        prop_assert_eq!(node_multisets(&refined), node_multisets(&spread));
        let lambda = |nodes: &[Vec<ExpertId>]| gpu_lambda(nodes, shape, &loads);
        let (before, after) = (lambda(&spread), lambda(&refined));
        prop_assert!(after <= before * (1.0 + 1e-9), "refined {} > spread {}", after, before);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn every_strategy_fills_every_slot(
        n in 1usize..12, g in 1usize..4, c in 1usize..4, seed in any::<u64>(),
    ) {
        let shape = ClusterShape::new(n, g, c).unwrap();
        let mut rng = SplitMix64::new(seed);
        let experts = 1 + rng.below(shape.total_slots());
        let r = random_replicas(&mut rng, experts, shape.total_slots());
        let loads: Vec<f64> = (0..experts).map(|_| rng.below(1000) as f64).collect();
        for strategy in Strategy::ALL {
            let p = place(&r, shape, strategy, Some(&loads)).unwrap();
            prop_assert_eq!(p.nodes().len(), n);
            prop_assert!(p.nodes().iter().all(|node| node.len() == g * c));
            prop_assert_eq!(p.replica_counts(), r.clone());
            // Valid by the same checks a user-supplied plan goes through.
            prop_assert!(Placement::from_nodes(shape, experts, p.nodes().to_vec()).is_ok());
            // Each GPU's expected tokens within one replica's weight of every other GPU's
            // on the same node (LPT guarantee).
            let w = |e: usize| loads[e] / r[e] as f64;
            for node in 0..n {
                let per: Vec<f64> = (0..g).map(|k| p.gpu(node, k).iter().map(|&e| w(e)).sum()).collect();
                let maxw = p.nodes()[node].iter().map(|&e| w(e)).fold(0.0, f64::max);
                let spread = per.iter().cloned().fold(f64::MIN, f64::max) - per.iter().cloned().fold(f64::MAX, f64::min);
                prop_assert!(spread <= maxw + 1e-9, "node {}: {:?}", node, per);
                // Each node's GPUs are what balancing that node alone gives (the balancer
                // reuses the previous node's result for an equal list).
                let mut alone = p.nodes()[node].clone();
                alone.reverse();
                let alone = balance_gpus(vec![alone], &r, ClusterShape::new(1, g, c).unwrap(), Some(&loads));
                prop_assert_eq!(&alone[0], &p.nodes()[node]);
            }
        }
    }

    #[test]
    fn lazarus_never_below_mro(n in 2usize..16, s in 2usize..7, seed in any::<u64>()) {
        let shape = ClusterShape::new(n, 1, s).unwrap();
        let mut rng = SplitMix64::new(seed);
        let experts = 2 + rng.below(n * s - 1);
        let r = random_replicas(&mut rng, experts, n * s);
        let ours = recovery_curve(&place(&r, shape, Strategy::Lazarus, None).unwrap());
        let mro = recovery_curve(&place(&r, shape, Strategy::Mro, None).unwrap());
        for (a, b) in ours.iter().zip(&mro) {
            if a.method == crate::RecoveryMethod::Exact && b.method == crate::RecoveryMethod::Exact {
                prop_assert!(a.probability >= b.probability - 1e-12, "r={:?} k={}: {} < {}", r, a.failed, a.probability, b.probability);
            }
        }
    }
}

proptest! {
    /// An even split of each expert's tokens over its replicas is one dispatch, so its busiest
    /// GPU is never below λ* (the throughput guard may trust it without a max-flow).
    #[test]
    fn the_even_split_bounds_the_balanced_dispatch_from_above(
        n in 1usize..6,
        g in 1usize..3,
        c in 1usize..4,
        weights in proptest::collection::vec(0u32..50, 1..8),
    ) {
        let shape = ClusterShape::new(n, g, c).unwrap();
        prop_assume!(weights.len() <= n * g * c);
        let loads: Vec<f64> = weights.iter().map(|&w| w as f64).collect();
        let replicas = crate::allocation::allocate(&loads, n * g * c, 1).unwrap().replicas;
        let p = place(&replicas, shape, Strategy::Lazarus, Some(&loads)).unwrap();
        let even = p.even_split_balance(&loads).unwrap();
        let best = p.load_balance(&loads).unwrap();
        prop_assert!(even.bottleneck >= best.bottleneck * (1.0 - 1e-9) - 1e-9, "{even:?} < {best:?}");
        prop_assert!((even.mean - best.mean).abs() <= 1e-9 * best.mean.max(1.0));
    }
}
