//! Adaptive replica allocation (paper §4.1, Eq. 1).
//!
//! Experts are visited in ascending order of load; each gets its proportional share of the slots
//! that are still free, but never fewer than the fault-tolerance floor `f`:
//!
//! r_e = max(floor(t_e / Σ_{e'≥e} t_e' · (S − Σ_{e'<e} r_e')), f),   S = N·G·c.
//!
//! Because each expert is the least loaded of the suffix it is drawn from, its share is at most
//! the suffix average, so the floor can always be honoured for the experts that follow and the
//! last expert takes exactly what is left: Σ r_e = S.

use serde::{Deserialize, Serialize};

use crate::error::PlanError;

/// Replica counts for one MoE layer, indexed by expert id (input order).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaAllocation {
    pub replicas: Vec<usize>,
    /// The floor that was asked for.
    pub requested_floor: usize,
    /// The floor that was applied: lowered to `S / E` when `f·E` replicas do not fit (the paper
    /// does this when only 5 nodes are left), and raised to 1 so no expert is left without state.
    pub applied_floor: usize,
}

/// Allocate `total_slots` replicas over experts with the given loads (tokens routed per expert).
///
/// Errors: empty, negative or non-finite loads; fewer slots than experts.
pub fn allocate(loads: &[f64], total_slots: usize, min_replicas: usize) -> Result<ReplicaAllocation, PlanError> {
    let experts = loads.len();
    if experts == 0 {
        return Err(PlanError::invalid("loads", "[]", "at least one expert is needed"));
    }
    for (e, &t) in loads.iter().enumerate() {
        if !t.is_finite() || t < 0.0 {
            return Err(PlanError::invalid("loads", format!("{t} (expert {e})"), "loads must be finite and non-negative"));
        }
    }
    if total_slots < experts {
        return Err(PlanError::CannotHost { experts, slots: total_slots });
    }
    let floor = min_replicas.max(1).min(total_slots / experts);

    // Ascending by load; ties by expert id so every machine computes the same plan.
    let mut order: Vec<usize> = (0..experts).collect();
    order.sort_by(|&a, &b| loads[a].total_cmp(&loads[b]).then(a.cmp(&b)));

    let integral = loads.iter().all(|&t| t.fract() == 0.0 && t <= (1u64 << 53) as f64);
    // Shares are scale-free; loads so large that their sum or t·slots overflows (1e308) are
    // divided by the largest first, or equal loads would get unequal replicas.
    let max = loads.iter().copied().fold(0.0f64, f64::max);
    let overflows = !loads.iter().sum::<f64>().is_finite() || !(max * total_slots as f64).is_finite();
    let scaled: Vec<f64>;
    let loads: &[f64] = if !integral && overflows {
        scaled = loads.iter().map(|&t| t / max).collect();
        &scaled
    } else {
        loads
    };
    let mut replicas = vec![0usize; experts];
    let mut remaining = total_slots;
    let mut suffix_load: f64 = loads.iter().sum();
    let mut suffix_int: u128 = if integral { loads.iter().map(|&t| t as u128).sum() } else { 0 };

    for (pos, &e) in order.iter().enumerate() {
        let left_after = experts - pos - 1;
        let share = if integral {
            let t = loads[e] as u128;
            match (t * remaining as u128).checked_div(suffix_int) {
                Some(share) => share as usize,
                None => remaining / (left_after + 1),
            }
        } else if suffix_load <= 0.0 {
            remaining / (left_after + 1)
        } else {
            proportional_floor(loads[e], suffix_load, remaining)
        };
        // Never take slots the experts after this one need for their floor; the last expert
        // takes everything that is left.
        let cap = remaining - floor * left_after;
        let r = if left_after == 0 { remaining } else { share.max(floor).min(cap) };
        replicas[e] = r;
        remaining -= r;
        suffix_load -= loads[e];
        if integral {
            suffix_int -= loads[e] as u128;
        }
    }
    debug_assert_eq!(replicas.iter().sum::<usize>(), total_slots);
    Ok(ReplicaAllocation { replicas, requested_floor: min_replicas, applied_floor: floor })
}

/// floor(t / suffix · remaining) for real-valued loads, multiplying first and snapping values
/// within a few ulps of an integer to it, so 0.3/0.9·30 gives 10 and not 9.
fn proportional_floor(t: f64, suffix: f64, remaining: usize) -> usize {
    let x = (t * remaining as f64 / suffix).min(remaining as f64);
    let nearest = x.round();
    if (x - nearest).abs() <= 1e-9 * nearest.max(1.0) {
        nearest as usize
    } else {
        x.floor() as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn loads_whose_sum_overflows_are_shares_like_any_others() {
        // `plan --loads 1e308,1e308,30,40` once gave the two equal loads unequal replicas.
        let a = allocate(&[1e308, 1e308, 30.0, 40.0], 20, 2).unwrap();
        assert_eq!(a.replicas[0], a.replicas[1], "{:?}", a.replicas);
        assert_eq!(a.replicas.iter().sum::<usize>(), 20);
        assert_eq!(
            allocate(&[1e308, 1e308, 1e307, 1e307], 12, 1).unwrap().replicas,
            allocate(&[10.0, 10.0, 1.0, 1.0], 12, 1).unwrap().replicas
        );
    }

    proptest! {
        #[test]
        fn allocation_does_not_depend_on_the_unit_of_the_loads(loads in proptest::collection::vec(0u32..1000, 1..12), extra in 0usize..20, exp in 0i32..300) {
            let loads: Vec<f64> = loads.iter().map(|&x| x as f64 + 0.5).collect();
            let slots = loads.len() + extra;
            let scale = 10f64.powi(exp);
            let big: Vec<f64> = loads.iter().map(|&x| x * scale).collect();
            prop_assume!(big.iter().all(|x| x.is_finite()));
            let (a, b) = (allocate(&loads, slots, 1).unwrap(), allocate(&big, slots, 1).unwrap());
            prop_assert_eq!(b.replicas.iter().sum::<usize>(), slots);
            // Equal loads get equal replicas (within the one the ascending sweep may add).
            for i in 0..loads.len() {
                for j in 0..loads.len() {
                    if big[i] == big[j] {
                        prop_assert!(b.replicas[i].abs_diff(b.replicas[j]) <= 1, "{:?} -> {:?}", big, b.replicas);
                    }
                }
            }
            let _ = a;
        }
    }

    #[test]
    fn proportional_to_load() {
        // 4 experts, 5 nodes x 4 slots, floor 2 (the paper's Figure 4 shape).
        let a = allocate(&[10.0, 20.0, 30.0, 40.0], 20, 2).unwrap();
        assert_eq!(a.replicas, vec![2, 4, 6, 8]);
        assert_eq!(a.applied_floor, 2);
    }

    #[test]
    fn floor_is_applied_to_cold_experts() {
        let a = allocate(&[1.0, 1.0, 100.0, 1000.0], 24, 3).unwrap();
        assert_eq!(a.replicas[0], 3);
        assert_eq!(a.replicas[1], 3);
        assert_eq!(a.replicas.iter().sum::<usize>(), 24);
        assert!(a.replicas[3] > a.replicas[2]);
    }

    #[test]
    fn floor_lowered_when_slots_are_short() {
        // 4 experts, floor 3 would need 12 slots; only 9 exist, so the floor becomes 2.
        let a = allocate(&[5.0, 5.0, 5.0, 5.0], 9, 3).unwrap();
        assert_eq!(a.applied_floor, 2);
        assert!(a.replicas.iter().all(|&r| r >= 2));
        assert_eq!(a.replicas.iter().sum::<usize>(), 9);
    }

    #[test]
    fn zero_load_experts_get_a_replica() {
        let a = allocate(&[0.0, 0.0, 7.0], 6, 0).unwrap();
        assert!(a.replicas.iter().all(|&r| r >= 1), "{:?}", a.replicas);
        let all_zero = allocate(&[0.0, 0.0, 0.0], 7, 1).unwrap();
        assert_eq!(all_zero.replicas.iter().sum::<usize>(), 7);
        assert!(all_zero.replicas.iter().max().unwrap() - all_zero.replicas.iter().min().unwrap() <= 1);
    }

    #[test]
    fn too_few_slots_is_an_error() {
        let err = allocate(&[1.0; 5], 4, 1).unwrap_err();
        assert_eq!(err, PlanError::CannotHost { experts: 5, slots: 4 });
    }

    #[test]
    fn bad_loads_are_rejected_with_field_and_value() {
        let err = allocate(&[1.0, f64::NAN], 4, 1).unwrap_err().to_string();
        assert!(err.contains("loads") && err.contains("NaN"), "{err}");
        let err = allocate(&[1.0, -2.0], 4, 1).unwrap_err().to_string();
        assert!(err.contains("-2"), "{err}");
        assert!(allocate(&[], 4, 1).is_err());
    }

    #[test]
    fn fractional_loads_are_not_cut_short_by_rounding() {
        // 0.3 / 0.9 * 30 is 10 exactly; naive float evaluation gives 9.999...
        let a = allocate(&[0.3, 0.6], 30, 1).unwrap();
        assert_eq!(a.replicas, vec![10, 20]);
    }

    proptest! {
        #[test]
        fn sums_to_slots_and_respects_floor(
            loads in prop::collection::vec(0u32..10_000, 1..40),
            slots_per in 1usize..8,
            floor in 0usize..5,
        ) {
            let loads: Vec<f64> = loads.into_iter().map(f64::from).collect();
            let total = loads.len() * slots_per + (slots_per * 7) % 5;
            let a = allocate(&loads, total, floor).unwrap();
            prop_assert_eq!(a.replicas.iter().sum::<usize>(), total);
            let applied = floor.max(1).min(total / loads.len());
            prop_assert_eq!(a.applied_floor, applied);
            prop_assert!(a.replicas.iter().all(|&r| r >= applied));
            // More load never means fewer replicas (ties aside).
            for i in 0..loads.len() {
                for j in 0..loads.len() {
                    if loads[i] < loads[j] {
                        prop_assert!(a.replicas[i] <= a.replicas[j] + 1,
                            "{:?} -> {:?}", loads, a.replicas);
                    }
                }
            }
        }
    }
}
