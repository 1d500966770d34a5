use super::rounding::AUGMENTS;
use super::*;
use proptest::prelude::*;

fn check_invariants(t: &[Vec<u64>], r: &[Vec<u32>], d: &DispatchSchedule) -> Result<(), TestCaseError> {
    let dense = d.dense();
    let ranks = t[0].len();
    for e in 0..t.len() {
        let te: u64 = t[e].iter().sum();
        let re: u64 = r[e].iter().map(|&x| x as u64).sum();
        let cap = apportion(te, &r[e]);
        for src in 0..ranks {
            // Conservation: every token routed on src is sent somewhere exactly once.
            prop_assert_eq!(dense[e][src].iter().sum::<u64>(), t[e][src]);
            // Local capacity first.
            prop_assert_eq!(dense[e][src][src], t[e][src].min(cap[src]));
        }
        for dst in 0..ranks {
            let got: u64 = (0..ranks).map(|s| dense[e][s][dst]).sum();
            // Each rank processes exactly its capacity, within one token of R·t/r.
            prop_assert_eq!(got, cap[dst]);
            let ideal = te as f64 * r[e][dst] as f64 / re.max(1) as f64;
            prop_assert!((got as f64 - ideal).abs() < 1.0);
            if r[e][dst] == 0 {
                prop_assert_eq!(got, 0);
            }
        }
        // Off-diagonal entries within one token of the proportional ideal of line 10.
        let excess: Vec<u64> = (0..ranks).map(|j| t[e][j] - dense[e][j][j]).collect();
        let resid: Vec<u64> = (0..ranks).map(|j| cap[j] - dense[e][j][j]).collect();
        let total: u64 = excess.iter().sum();
        for src in 0..ranks {
            for dst in 0..ranks {
                if src == dst || total == 0 {
                    continue;
                }
                let ideal = excess[src] as f64 * resid[dst] as f64 / total as f64;
                prop_assert!(
                    (dense[e][src][dst] as f64 - ideal).abs() < 1.0,
                    "e={} {}->{}: {} vs ideal {}",
                    e,
                    src,
                    dst,
                    dense[e][src][dst],
                    ideal
                );
            }
        }
    }
    Ok(())
}

#[test]
fn two_replicas_on_one_rank_get_two_shares() {
    // Expert 0: 3 replicas, two on rank 1. 90 tokens all routed on rank 0.
    let t = vec![vec![90, 0, 0]];
    let r = vec![vec![1, 2, 0]];
    let d = DispatchSchedule::compute(&t, &r).unwrap();
    assert_eq!(d.get(0, 0, 0), 30);
    assert_eq!(d.get(0, 0, 1), 60);
    assert_eq!(d.processed_per_rank(), vec![30, 60, 0]);
    assert_eq!(d.send_counts(0), vec![30, 60, 0]);
    assert_eq!(d.recv_counts(1), vec![60, 0, 0]);
}

/// Simulate every rank: lay out, "send", let each receiver tag rows with (expert, rank),
/// send back, and check every slot got its own expert processed on a rank holding it.
#[test]
fn rank_layouts_round_trip_every_slot() {
    let mut rng = crate::rng::SplitMix64::new(5);
    for _ in 0..200 {
        let ranks = 1 + rng.below(5);
        let experts = 1 + rng.below(6);
        let r: Vec<Vec<u32>> = (0..experts)
            .map(|_| {
                let mut v: Vec<u32> = (0..ranks).map(|_| rng.below(3) as u32).collect();
                let k = rng.below(ranks);
                v[k] = v[k].max(1);
                v
            })
            .collect();
        let choices: Vec<Vec<u32>> = (0..ranks).map(|_| (0..rng.below(40)).map(|_| rng.below(experts) as u32).collect()).collect();
        let mut t = vec![vec![0u64; ranks]; experts];
        for (rank, c) in choices.iter().enumerate() {
            c.iter().for_each(|&e| t[e as usize][rank] += 1);
        }
        let d = DispatchSchedule::compute(&t, &r).unwrap();
        let layouts: Vec<RankLayout> = (0..ranks).map(|me| RankLayout::new(&d, me, &choices[me]).unwrap()).collect();
        // What each receiver gets from each sender: (expert of each row).
        let mut result: Vec<Vec<Option<(u32, usize)>>> = choices.iter().map(|c| vec![None; c.len()]).collect();
        for dst in 0..ranks {
            for src in 0..ranks {
                let rows = &layouts[src].send_experts[dst];
                // The receiver's view of the layout matches what the sender packed.
                let expected: Vec<u32> =
                    (0..experts).flat_map(|e| std::iter::repeat_n(e as u32, layouts[dst].recv[src][e] as usize)).collect();
                assert_eq!(rows, &expected);
                for (i, &e) in rows.iter().enumerate() {
                    assert!(r[e as usize][dst] > 0, "expert {e} sent to rank {dst} without a replica");
                    let slot = layouts[src].send[dst][i] as usize;
                    assert!(result[src][slot].is_none(), "slot sent twice");
                    result[src][slot] = Some((e, dst));
                }
            }
        }
        for (rank, c) in choices.iter().enumerate() {
            for (slot, &e) in c.iter().enumerate() {
                assert_eq!(result[rank][slot].map(|x| x.0), Some(e), "rank {rank} slot {slot}");
            }
        }
    }
}

#[test]
fn rank_layout_rejects_choices_that_disagree_with_the_schedule() {
    let d = DispatchSchedule::compute(&[vec![2, 0]], &[vec![1, 1]]).unwrap();
    assert!(RankLayout::new(&d, 0, &[0]).is_err());
    assert!(RankLayout::new(&d, 0, &[0, 0, 0]).is_err());
    assert!(RankLayout::new(&d, 0, &[0, 5]).is_err());
    assert!(RankLayout::new(&d, 2, &[0, 0]).is_err());
    let ok = RankLayout::new(&d, 0, &[0, 0]).unwrap();
    assert_eq!(ok.send, vec![vec![0], vec![1]]);
}

#[test]
fn tokens_without_a_replica_are_an_error() {
    let err = DispatchSchedule::compute(&[vec![1, 0]], &[vec![0, 0]]).unwrap_err().to_string();
    assert!(err.contains("expert 0"), "{err}");
    assert!(DispatchSchedule::compute(&[vec![1, 0]], &[vec![1]]).is_err());
    assert!(DispatchSchedule::compute(&[vec![1, 0]], &[]).is_err());
}

#[test]
fn apportion_is_exact_and_within_one() {
    assert_eq!(apportion(10, &[1, 1, 1]), vec![4, 3, 3]);
    assert_eq!(apportion(0, &[1, 2]), vec![0, 0]);
    assert_eq!(apportion(7, &[0, 3, 0, 4]), vec![0, 3, 0, 4]);
}

/// Small counts leave cells whose ideal is an integer, where Ryser's greedy can get stuck;
/// make sure the augmenting-path repair runs and still yields a valid schedule.
#[test]
fn augmenting_repair_is_exercised() {
    let before = AUGMENTS.load(std::sync::atomic::Ordering::Relaxed);
    let mut rng = crate::rng::SplitMix64::new(7);
    for _ in 0..20_000 {
        let ranks = 3 + rng.below(5);
        let t = vec![(0..ranks).map(|_| rng.below(7) as u64).collect::<Vec<_>>()];
        let r = vec![(0..ranks).map(|_| rng.below(3) as u32).collect::<Vec<_>>()];
        if r[0].iter().all(|&x| x == 0) {
            continue;
        }
        let d = DispatchSchedule::compute(&t, &r).unwrap();
        check_invariants(&t, &r, &d).unwrap();
    }
    assert!(AUGMENTS.load(std::sync::atomic::Ordering::Relaxed) > before, "repair path never taken");
}

proptest! {
    #[test]
    fn schedule_invariants(
        ranks in 1usize..9,
        experts in 1usize..7,
        seed in any::<u64>(),
    ) {
        let mut rng = crate::rng::SplitMix64::new(seed);
        let t: Vec<Vec<u64>> = (0..experts)
            .map(|_| (0..ranks).map(|_| if rng.below(4) == 0 { 0 } else { rng.below(500) as u64 }).collect())
            .collect();
        let r: Vec<Vec<u32>> = (0..experts)
            .map(|_| {
                let mut v: Vec<u32> = (0..ranks).map(|_| if rng.below(2) == 0 { 0 } else { rng.below(3) as u32 }).collect();
                let k = rng.below(ranks);
                v[k] = v[k].max(1);
                v
            })
            .collect();
        // Whole blocks (deterministic training): each sender's tokens for an expert in one
        // route, to a holder — itself when it holds the expert.
        let w = DispatchSchedule::compute_whole(&t, &r).unwrap();
        for e in 0..experts {
            for src in 0..ranks {
                let to: Vec<&Route> = w.routes(e).iter().filter(|x| x.src as usize == src).collect();
                if t[e][src] == 0 {
                    prop_assert!(to.is_empty());
                    continue;
                }
                prop_assert_eq!(to.len(), 1);
                prop_assert_eq!(to[0].tokens, t[e][src]);
                prop_assert!(r[e][to[0].dst as usize] > 0, "to a holder");
                if r[e][src] > 0 {
                    prop_assert_eq!(to[0].dst as usize, src);
                }
            }
        }
        let d = DispatchSchedule::compute(&t, &r).unwrap();
        check_invariants(&t, &r, &d)?;
        // A pure function: any rank recomputing it gets the same matrix.
        prop_assert_eq!(DispatchSchedule::compute(&t, &r).unwrap(), d.clone());

        // The rank-balanced variant: tokens conserved, only holders process, local first
        // under its own capacities, and no rank busier than under per-replica shares.
        let b = DispatchSchedule::compute_balanced(&t, &r).unwrap();
        prop_assert_eq!(DispatchSchedule::compute_balanced(&t, &r).unwrap(), b.clone());
        let caps = balanced_capacities(&t, &r);
        let dense = b.dense();
        for e in 0..experts {
            prop_assert_eq!(caps[e].iter().sum::<u64>(), t[e].iter().sum::<u64>());
            for src in 0..ranks {
                prop_assert_eq!(dense[e][src].iter().sum::<u64>(), t[e][src]);
                prop_assert_eq!(dense[e][src][src], t[e][src].min(caps[e][src]));
            }
            for dst in 0..ranks {
                let got: u64 = (0..ranks).map(|s| dense[e][s][dst]).sum();
                prop_assert_eq!(got, caps[e][dst]);
                if r[e][dst] == 0 {
                    prop_assert_eq!(got, 0);
                }
            }
        }
        let max = |v: Vec<u64>| v.into_iter().max().unwrap_or(0);
        prop_assert!(max(b.processed_per_rank()) <= max(d.processed_per_rank()));
    }
}

#[test]
fn balancing_evens_out_a_hot_expert_spread_three_two_two_two() {
    // 9 replicas of expert 0 over 4 ranks (3, 2, 2, 2), 900 tokens from each rank.
    let t = vec![vec![900u64; 4]];
    let r = vec![vec![3u32, 2, 2, 2]];
    let per_replica = DispatchSchedule::compute(&t, &r).unwrap().processed_per_rank();
    assert_eq!(per_replica, vec![1200, 800, 800, 800]);
    let balanced = DispatchSchedule::compute_balanced(&t, &r).unwrap().processed_per_rank();
    assert_eq!(balanced, vec![900, 900, 900, 900]);
    // Holder sets limit it: expert 1 lives only on rank 0, so rank 0 gives away all of 0.
    let t = vec![vec![100u64, 100], vec![300, 0]];
    let r = vec![vec![1u32, 1], vec![1, 0]];
    let caps = balanced_capacities(&t, &r);
    assert_eq!(caps, vec![vec![0, 200], vec![300, 0]]);
}
