//! Joiners under the rule that lets them ride along: where moves come often, they wait until
//! waiting has cost a move of their own, and any move the job makes before then — a
//! failure's, a rebalance that repays itself — takes them along.

use super::*;

/// A running job of nodes 10, 11, 12 whose joiners may ride along (at most a minute) after a
/// 2 s join wait, having measured a move whose fixed part took `fixed_s`, and seen a move made
/// for another reason at its start (moves come often).
fn renting(fixed_s: f64, t0: Instant) -> Controller {
    let mut c = running(3, 4, 2, t0);
    c.spec.join_rule = JoinRule::WhenRepaid { at_most: 60 * SEC };
    c.moves_for_others = 1;
    let moved = MoveCost { bytes: 1000, transfer_s: 0.01, rebuild_s: fixed_s };
    c.decide(t0, Event::StepDone { epoch: 0, step: 1, steps: 1, loads: vec![vec![1, 1, 1, 1]; 2], seconds: 0.1, moved: Some(moved) });
    c
}

#[test]
fn a_joiner_waits_until_its_idling_has_cost_a_move_of_its_own() {
    let t0 = Instant::now();
    // 5 s moves, one worker joining three: 5 × 4 / 1 = 20 s.
    let mut c = renting(5.0, t0);
    assert_eq!(c.join_wait_for(t0, 1), 20 * SEC);
    assert!(c.decide(t0, Event::Joined { workers: vec![20] }).is_empty());
    // Past the join wait, nothing; heartbeats keep every member and the joiner.
    for half_seconds in 1..40 {
        let t = t0 + SEC * half_seconds / 2;
        assert!(beat(&mut c, t).is_empty(), "paused at {half_seconds}/2 s");
        assert!(c.next_wake(t) <= t0 + 20 * SEC);
    }
    let out = beat(&mut c, t0 + 20 * SEC);
    assert_eq!(out, vec![Command::Pause { epoch: 0, nodes: vec![10, 11, 12] }]);
    // Capped: a minute at most, and never less than the join wait.
    assert_eq!(renting(100.0, t0).join_wait_for(t0, 1), 60 * SEC);
    assert_eq!(renting(0.1, t0).join_wait_for(t0, 1), 2 * SEC);
    assert_eq!(running(3, 4, 2, t0).join_wait_for(t0, 1), 2 * SEC, "the paper's rule: the join wait");
    // Moves seldom (one in 100 s, against 20 s of idling to cost one), or none seen: no longer.
    assert_eq!(renting(5.0, t0).join_wait_for(t0 + 100 * SEC, 1), 2 * SEC);
    let mut quiet = renting(5.0, t0);
    quiet.moves_for_others = 0;
    assert_eq!(quiet.join_wait_for(t0, 1), 2 * SEC);
}

#[test]
fn a_failure_before_then_takes_the_joiner_along() {
    let t0 = Instant::now();
    let mut c = renting(5.0, t0);
    c.decide(t0, Event::Joined { workers: vec![20] });
    beat(&mut c, t0 + SEC / 2);
    let t = t0 + SEC;
    c.decide(t, Event::Exited { node: 12, status: "killed".into() });
    c.decide(t, Event::StepFailed { node: 10, epoch: 0, report: stopped_at(3, &c, 10) });
    let out = c.decide(t, Event::StepFailed { node: 11, epoch: 0, report: stopped_at(3, &c, 11) });
    let [Command::Reconfigure(m)] = &out[..] else { panic!("{out:?}") };
    assert_eq!(m.cause, MoveCause::Failure);
    assert!(m.ranks.contains(&20) && c.standby().next().is_none());
}

/// Loads drift while a worker stands by: under the rent-or-buy rule the rebalance is weighed
/// anyway, and its move takes the joiner along; under the paper's rule the weighing waits for
/// the join's move.
#[test]
fn a_rebalance_that_repays_its_move_takes_the_joiner_along() {
    let t0 = Instant::now();
    let drift = |c: &mut Controller| -> Vec<Command> {
        (2..=5)
            .flat_map(|step| {
                let loads = vec![vec![97, 1, 1, 1]; 2];
                c.decide_inline(t0, Event::StepDone { epoch: 0, step, steps: 1, loads, seconds: 2.0, moved: None })
            })
            .collect()
    };
    let mut c = renting(0.05, t0);
    c.spec.rebalance_every = 4;
    c.decide(t0, Event::Joined { workers: vec![20] });
    let out = drift(&mut c);
    let [Command::Rebalance(d), Command::Pause { epoch: 0, .. }] = &out[..] else { panic!("{out:?}") };
    assert_eq!(d.decision, RebalanceVerdict::Apply);
    let notes: Vec<&String> = c.recent().collect();
    assert!(notes.iter().any(|n| n.contains("workers 20 waiting to join ride along")), "{notes:?}");
    let mut out = Vec::new();
    for n in [10, 11, 12] {
        out.extend(c.decide(t0, Event::StepFailed { node: n, epoch: 0, report: stopped_at(5, &c, n) }));
    }
    let [Command::Reconfigure(m)] = &out[..] else { panic!("{out:?}") };
    assert_eq!((m.cause, m.ranks.len()), (MoveCause::Rebalance, 4));
    assert_eq!(m.change.joining, vec![m.ranks.iter().position(|&n| n == 20).unwrap()]);
    // The paper's rule: no weighing while the joiner waits.
    let mut c = running(3, 4, 2, t0);
    c.spec.rebalance_every = 4;
    c.decide(t0, Event::Joined { workers: vec![20] });
    assert!(drift(&mut c).is_empty());
}
