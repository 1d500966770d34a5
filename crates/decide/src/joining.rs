//! When workers that join a running job are taken in: the paper's fixed wait (§4.3, to batch
//! arrivals), or — beyond the paper — a wait for the next move the job makes anyway, when
//! moves come often enough for that to pay.
//!
//! Why: a move of its own for joiners pauses every GPU of the job for the move's fixed part
//! (pause, rendezvous, communicator rebuild: the paper's 5–15 s), while a move the job makes
//! anyway — a failure's, a drain's, a rebalance that repays itself — takes the joiners along
//! for their transfers only (paid whichever move takes them, so only the fixed part `R` is
//! weighed). Waiting costs the joiners' share `δ` of the job's throughput while they idle. At a
//! failure every 10 minutes on 1,024 GPUs, half of the moves were joins of repaired nodes.
//!
//! The rule, [`join_deferral`]: with moves coming on average every `M` seconds (as the
//! controller has seen them: time since the start over the moves made for other reasons), and
//! arrivals taken as memoryless, waiting for the next one costs `δ·M` against `R` for a move of
//! their own — so they wait only if `δ·M < R`, and then at most `R/δ`, the rent-or-buy bound
//! (ski rental: Karlin, Manasse, McGeoch, Owicki, *Competitive randomized algorithms for
//! non-uniform problems*, 1988): if moves stop coming, what they lose idling is at most a
//! move's cost, and the whole at most twice what the best choice made knowing the future would
//! have cost. A small job (one node of 16: `δ·M` large) takes joiners in at once, as the
//! paper does; a large one that fails often (one node of 128, a failure every 10 minutes:
//! `δ·M` ≈ 5 s against 10 s) lets them ride along.
//!
//! States: a joiner stands by from its arrival until a move takes it in (any move: the
//! controller's recovery takes every worker standing by) or until it is due (arrival + the
//! wait), when the controller pauses for it at a step boundary. Invariants: it waits at least
//! the job's join wait and never longer than that or `at_most`, whichever is longer; before the
//! controller has seen a move made for another reason it waits the join wait only.

use std::time::Duration;

/// The longest a joiner waits under [`JoinRule::WhenRepaid`] where the job gives no other cap
/// (`lazarus controller --join-rule repaid`, `lazarus sim --join-rule repaid`): half an hour,
/// longer than the rule asks for one node of 128 at the paper's 10 s rebuilds (21 minutes).
pub const REPAID_JOIN_AT_MOST: Duration = Duration::from_secs(1800);

/// When the controller takes in workers that joined a running job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JoinRule {
    /// After the job's join wait, at the next step boundary (paper §4.3); a recovery before
    /// then takes them along.
    AfterWait,
    /// With the next move the job makes anyway where moves come often enough for waiting to
    /// pay ([`join_deferral`]; at least the join wait, at most `at_most` or the join wait): a
    /// rebalance that repays itself takes them along too.
    WhenRepaid { at_most: Duration },
}

/// What [`join_deferral`] weighs: a move's measured fixed part, the workers joining and in the
/// job, and how often moves made for other reasons have come.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct JoinCase {
    /// Seconds of the whole job a move of its own costs (the last measured move's fixed part).
    pub fixed_s: f64,
    pub joining: usize,
    pub in_job: usize,
    /// Mean seconds between moves the job made for other reasons (None: none seen yet).
    pub mean_between_moves_s: Option<f64>,
}

/// How long the joiners of `case` wait for another move to ride along (beyond nothing: the
/// caller adds the join wait): `R/δ` capped at `at_most` if moves come every `M < R/δ`
/// seconds on average, else nothing (see the module's note). `δ = joining / (in_job +
/// joining)`: their share of the throughput, taken as the share of the workers.
pub fn join_deferral(case: JoinCase, at_most: Duration) -> Duration {
    let JoinCase { fixed_s, joining, in_job, mean_between_moves_s } = case;
    if joining == 0 || !fixed_s.is_finite() || fixed_s <= 0.0 {
        return Duration::ZERO;
    }
    // R/δ: waiting that long idles as much as a move of their own costs.
    let bound_s = fixed_s * (in_job + joining) as f64 / joining as f64;
    match mean_between_moves_s {
        Some(m) if m.is_finite() && m >= 0.0 && m < bound_s => {
            if bound_s >= at_most.as_secs_f64() {
                at_most
            } else {
                Duration::from_secs_f64(bound_s)
            }
        }
        _ => Duration::ZERO,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn case(fixed_s: f64, joining: usize, in_job: usize, mean_between_moves_s: Option<f64>) -> JoinCase {
        JoinCase { fixed_s, joining, in_job, mean_between_moves_s }
    }

    #[test]
    fn a_large_job_that_fails_often_waits_and_a_small_one_does_not() {
        let cap = Duration::from_secs(1800);
        // One node of 8 GPUs joining 127 others, 10 s moves, a failure every 10 minutes:
        // δ·M = 600 / 128 ≈ 4.7 s < 10 s, so wait up to 10 × 1,024 / 8 = 1,280 s.
        assert_eq!(join_deferral(case(10.0, 8, 1016, Some(600.0)), cap), Duration::from_secs(1280));
        // One node of 16, a failure every 11 minutes: δ·M = 41 s > 12 s, taken in at once.
        assert_eq!(join_deferral(case(12.0, 1, 15, Some(660.0)), cap), Duration::ZERO);
        // Moves seldom (one a day), or none seen yet: at once.
        assert_eq!(join_deferral(case(10.0, 8, 1016, Some(86_400.0)), cap), Duration::ZERO);
        assert_eq!(join_deferral(case(10.0, 8, 1016, None), cap), Duration::ZERO);
        // Capped; nothing to weigh waits nothing.
        assert_eq!(join_deferral(case(10.0, 1, 1023, Some(60.0)), cap), cap);
        for bad in [f64::NAN, -1.0, f64::INFINITY, 0.0] {
            assert_eq!(join_deferral(case(bad, 1, 3, Some(0.01)), cap), Duration::ZERO, "{bad}");
            assert_eq!(join_deferral(case(1.0, 1, 3, Some(bad)), cap), if bad == 0.0 { Duration::from_secs(4) } else { Duration::ZERO });
        }
        assert_eq!(join_deferral(case(10.0, 0, 3, Some(1.0)), cap), Duration::ZERO);
    }

    /// What waiting `w` costs when the next move comes after `t`: the idling until then if it
    /// comes first, else the idling for `w` and a move of their own.
    fn cost(w: f64, t: f64, fixed: f64, share: f64) -> f64 {
        if t <= w {
            t * share
        } else {
            w * share + fixed
        }
    }

    proptest! {
        /// When the rule waits, it costs at most twice the best choice made knowing when the
        /// next move comes (taking them in at once, or waiting for it), whenever that is; and
        /// it waits only when moves come often enough that waiting costs less on average than
        /// a move (memoryless arrivals at the mean seen).
        #[test]
        fn waiting_costs_at_most_twice_the_hindsight_choice_and_less_on_average(
            fixed in 0.01f64..100.0,
            joining in 1usize..64,
            in_job in 0usize..4096,
            mean in 0.0f64..1e5,
            next_move in 0.0f64..1e6,
        ) {
            let share = joining as f64 / (in_job + joining) as f64;
            let w = join_deferral(case(fixed, joining, in_job, Some(mean)), Duration::MAX).as_secs_f64();
            if w > 0.0 {
                let hindsight = (next_move * share).min(fixed);
                let paid = cost(w, next_move, fixed, share);
                prop_assert!(paid <= 2.0 * hindsight * (1.0 + 1e-9) + 1e-9, "{} > 2 × {}", paid, hindsight);
                // Expected cost with exponential arrivals of mean `mean`: δ·m·(1 − e^(−w/m)) + R·e^(−w/m).
                let stay = (-w / mean).exp();
                prop_assert!(share * mean * (1.0 - stay) + fixed * stay <= fixed * (1.0 + 1e-9));
            } else {
                prop_assert!(share * mean >= fixed * (1.0 - 1e-9), "took them in although waiting paid on average");
            }
        }

        /// More joiners, or a smaller job, gain more by being taken in: they wait no longer.
        #[test]
        fn more_joiners_wait_no_longer(fixed in 0.01f64..100.0, joining in 1usize..64, in_job in 0usize..4096, mean in 0.0f64..1e4) {
            let cap = Duration::from_secs(3600);
            let w = join_deferral(case(fixed, joining, in_job, Some(mean)), cap);
            prop_assert!(join_deferral(case(fixed, joining + 1, in_job, Some(mean)), cap) <= w);
            prop_assert!(join_deferral(case(fixed, joining, in_job.saturating_sub(1), Some(mean)), cap) <= w);
            prop_assert!(w <= cap);
        }
    }
}
