use super::*;

fn report(step: u64) -> StepReport {
    StepReport { step, loss: 1.0, aux_loss: 0.0, tokens: 8, lr: 1e-3, grad_norm: 1.0, expert_load: vec![], dropped: 0 }
}

fn ev(rank: usize, e: WorkerEvent) -> Input {
    Input::Event(rank, e)
}

fn step_event(step: u64) -> WorkerEvent {
    WorkerEvent::Step { report: report(step), seconds: 0.1, wire_bytes: 0, dropped: 0, snapshot: None }
}

const SEC: Duration = Duration::from_secs(1);

/// A started job of `world` ranks, at time `t0`.
fn started(world: usize, t0: Instant) -> Supervisor {
    let mut s = Supervisor::new(world, t0, 60 * SEC, 5 * SEC);
    for r in 0..world {
        s.on(t0, ev(r, WorkerEvent::Listening { addr: format!("127.0.0.1:{}", 1000 + r), epoch: 0 }));
    }
    for r in 0..world {
        s.on(t0, ev(r, WorkerEvent::Ready { pid: 100 + r as u32, epoch: 0, moved: None }));
    }
    s
}

#[test]
fn addresses_go_out_once_every_rank_listens_and_steps_wait_for_every_rank_to_be_ready() {
    let t0 = Instant::now();
    let mut s = Supervisor::new(3, t0, 60 * SEC, 5 * SEC);
    assert_eq!(s.deadline(), Some(t0 + 60 * SEC));
    assert!(s.on(t0, ev(1, WorkerEvent::Listening { addr: "b".into(), epoch: 0 })).is_empty());
    assert!(s.on(t0, ev(0, WorkerEvent::Listening { addr: "a".into(), epoch: 0 })).is_empty());
    let a = s.on(t0, ev(2, WorkerEvent::Listening { addr: "c".into(), epoch: 0 }));
    assert_eq!(a, vec![Action::SendAddresses(vec!["a".into(), "b".into(), "c".into()])]);
    assert_eq!(s.on(t0, ev(0, WorkerEvent::Ready { pid: 7, epoch: 0, moved: None })), vec![Action::Ready { rank: 0, pid: 7 }]);
    assert_eq!(s.on(t0, ev(1, WorkerEvent::Ready { pid: 8, epoch: 0, moved: None })), vec![Action::Ready { rank: 1, pid: 8 }]);
    // Rank 0 steps before rank 2 reports ready: held back, then released in order.
    assert!(s.on(t0, ev(0, step_event(1))).is_empty());
    assert!(s.on(t0, ev(0, step_event(2))).is_empty());
    let a = s.on(t0, ev(2, WorkerEvent::Ready { pid: 9, epoch: 0, moved: None }));
    assert_eq!(a.len(), 4);
    assert_eq!(a[0], Action::Ready { rank: 2, pid: 9 });
    assert_eq!(a[1], Action::Started);
    assert!(matches!(&a[2], Action::Step { report, .. } if report.step == 1));
    assert!(matches!(&a[3], Action::Step { report, .. } if report.step == 2));
    assert_eq!(s.deadline(), None, "a running job has no deadline");
    assert!(matches!(&s.on(t0, ev(0, step_event(3)))[..], [Action::Step { report, .. }] if report.step == 3));
}

#[test]
fn every_rank_done_completes_with_rank_zeros_checkpoint() {
    let t0 = Instant::now();
    let mut s = started(2, t0);
    assert!(s.on(t0, ev(1, WorkerEvent::Done { checkpoint: None })).is_empty());
    let a = s.on(t0, ev(0, WorkerEvent::Done { checkpoint: Some("ck/step-1".into()) }));
    assert_eq!(a, vec![Action::Finish(Outcome::Completed { checkpoint: Some("ck/step-1".into()), bench: None })]);
    assert!(s.is_finished());
    assert!(s.on(t0, Input::Tick).is_empty(), "nothing after the end");
    // A process ending after its final word is no failure.
    assert!(s.on(t0, Input::Exited(1, "exit code 0".into())).is_empty());
}

#[test]
fn a_death_waits_for_the_survivors_within_the_grace_and_names_the_first_failure() {
    let t0 = Instant::now();
    let mut s = started(3, t0);
    let a = s.on(t0 + SEC, Input::Exited(1, "killed by signal 9".into()));
    assert_eq!(a, vec![Action::RankStopped { rank: 1, end: RankEnd::Died { status: "killed by signal 9".into() }, after: None }]);
    assert_eq!(s.deadline(), Some(t0 + SEC + 5 * SEC));
    let lost = WorkerEvent::Failed { kind: FailureKind::PeerLost, message: "peer 1 lost".into() };
    let a = s.on(t0 + SEC + Duration::from_millis(3), ev(0, lost.clone()));
    assert!(matches!(&a[..], [Action::RankStopped { rank: 0, after: Some(d), .. }] if *d == Duration::from_millis(3)));
    // Its exit after the report changes nothing.
    assert!(s.on(t0 + 2 * SEC, Input::Exited(0, "exit code 1".into())).is_empty());
    let a = s.on(t0 + 2 * SEC, ev(2, lost));
    let [Action::RankStopped { rank: 2, .. }, Action::Finish(Outcome::Failed { first, ranks })] = &a[..] else { panic!("{a:?}") };
    assert_eq!(first.0, 1);
    assert_eq!(ranks.iter().map(RankEnd::short).collect::<Vec<_>>(), ["peer_lost", "died", "peer_lost"]);
}

#[test]
fn a_silent_survivor_is_given_up_on_at_the_end_of_the_grace() {
    let t0 = Instant::now();
    let mut s = started(2, t0);
    s.on(t0, ev(0, WorkerEvent::Failed { kind: FailureKind::Timeout, message: "late".into() }));
    assert!(s.on(t0 + 4 * SEC, Input::Tick).is_empty());
    let a = s.on(t0 + 5 * SEC, Input::Tick);
    let [Action::Finish(Outcome::Failed { first, ranks })] = &a[..] else { panic!("{a:?}") };
    assert_eq!(first, &(0, RankEnd::Failed { kind: FailureKind::Timeout, message: "late".into() }));
    assert_eq!(ranks[1], RankEnd::NoAnswer);
}

#[test]
fn a_job_that_never_starts_times_out_and_a_failure_before_start_is_a_failure() {
    let t0 = Instant::now();
    let mut s = Supervisor::new(2, t0, 60 * SEC, 5 * SEC);
    s.on(t0, ev(0, WorkerEvent::Listening { addr: "a".into(), epoch: 0 }));
    assert!(s.on(t0 + 59 * SEC, Input::Tick).is_empty());
    assert_eq!(s.on(t0 + 60 * SEC, Input::Tick), vec![Action::Finish(Outcome::StartTimeout { ready: 0, world: 2, waited: 60 * SEC })]);
    let mut s = Supervisor::new(2, t0, 60 * SEC, 5 * SEC);
    s.on(t0, ev(1, WorkerEvent::Failed { kind: FailureKind::Config, message: "bad placement".into() }));
    let a = s.on(t0, Input::Exited(0, "exit code 1".into()));
    assert!(matches!(
        &a[..],
        [Action::RankStopped { .. }, Action::Finish(Outcome::Failed { first: (1, RankEnd::Failed { kind: FailureKind::Config, .. }), .. })]
    ));
}

#[test]
fn bench_results_finish_rank_zero_and_come_back_with_the_outcome() {
    let t0 = Instant::now();
    let mut s = started(2, t0);
    s.on(t0, ev(1, WorkerEvent::Done { checkpoint: None }));
    let a = s.on(t0, ev(0, WorkerEvent::BenchResults { results: vec![] }));
    assert_eq!(a, vec![Action::Finish(Outcome::Completed { checkpoint: None, bench: Some(vec![]) })]);
}

#[test]
fn reports_from_ranks_that_do_not_exist_are_ignored() {
    let t0 = Instant::now();
    let mut s = started(2, t0);
    assert!(s.on(t0, ev(7, WorkerEvent::Done { checkpoint: None })).is_empty());
    assert!(s.on(t0, Input::Exited(9, "x".into())).is_empty());
    assert!(!s.is_finished());
}
