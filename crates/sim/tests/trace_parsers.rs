//! Property tests for every parser of the simulator's inputs: random and mutated inputs to
//! `parse_bamboo`, `parse_availability`, `parse_duration_ms` and `LoadModel::from_trace_json`
//! return `Ok` or an error, never panic, and what they return is well-formed. Then random
//! well-formed traces through `simulate`: every policy finishes and accounts for every second.

use std::collections::HashSet;

use lazarus_sim::{
    parse_duration_ms, simulate, Change, CostModel, LoadModel, ModelSpec, Policy, Scenario, SimError, Trace, MAX_EVENTS, MAX_NODES,
};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

/// Events in time order, at least one, every add of an absent node, every remove of a present
/// one (so preceded by its add), never more than `MAX_NODES` present; and `Trace::validate`
/// agrees.
fn check_well_formed(t: &Trace) -> Result<(), TestCaseError> {
    prop_assert!(!t.events.is_empty(), "an Ok trace holds events");
    prop_assert!(t.events.len() <= MAX_EVENTS);
    let mut present: HashSet<&str> = HashSet::new();
    let mut last = 0u64;
    for (i, ev) in t.events.iter().enumerate() {
        prop_assert!(ev.ms >= last, "event {} at {} ms after {} ms", i, ev.ms, last);
        last = ev.ms;
        prop_assert!(!ev.node.is_empty());
        match ev.change {
            Change::Add => prop_assert!(present.insert(&ev.node), "event {}: {:?} added twice", i, ev.node),
            Change::Remove => prop_assert!(present.remove(ev.node.as_str()), "event {}: {:?} removed without an add", i, ev.node),
        }
        prop_assert!(present.len() <= MAX_NODES);
    }
    prop_assert!(t.validate().is_ok(), "{:?}", t.validate());
    Ok(())
}

/// An error is one of the parser's own, with a message.
fn check_error(e: &SimError, source: &str) -> Result<(), TestCaseError> {
    let msg = e.to_string();
    prop_assert!(!msg.is_empty());
    if let SimError::Trace { source_name, line, .. } = e {
        prop_assert_eq!(source_name.as_str(), source);
        prop_assert!(*line >= 1);
    }
    Ok(())
}

/// Edits applied to a text: (position, kind, character); positions wrap around the length.
fn mutations() -> impl Strategy<Value = Vec<(usize, u8, char)>> {
    prop::collection::vec(
        (any::<usize>(), 0u8..3, prop_oneof![Just(','), Just('\n'), Just('-'), Just('9'), Just('#'), any::<char>()]),
        0..4,
    )
}

fn mutate(text: &str, edits: &[(usize, u8, char)]) -> String {
    let mut chars: Vec<char> = text.chars().collect();
    for &(pos, kind, c) in edits {
        let at = pos % (chars.len() + 1);
        match kind {
            0 => chars.insert(at, c),
            1 if at < chars.len() => {
                chars.remove(at);
            }
            _ if at < chars.len() => chars[at] = c,
            _ => chars.push(c),
        }
    }
    chars.into_iter().collect()
}

/// A valid Bamboo trace from (time step, node index) pairs: a node's event adds it when absent
/// and removes it when present.
fn bamboo_text(ops: &[(u16, u8)]) -> String {
    let mut present = [false; 8];
    let (mut t, mut out) = (0u64, String::new());
    for &(dt, n) in ops {
        t += dt as u64;
        let n = (n % 8) as usize;
        let ev = if present[n] { "remove" } else { "add" };
        present[n] = !present[n];
        out.push_str(&format!("{t},{ev},n{n}\n"));
    }
    out
}

fn field() -> impl Strategy<Value = String> {
    prop_oneof![
        (0u64..100_000).prop_map(|x| x.to_string()),
        any::<u64>().prop_map(|x| x.to_string()),
        "-?[0-9]{0,24}(\\.[0-9]{0,3})?(e[0-9]{1,3})?",
        Just("add".to_string()),
        Just("remove".to_string()),
        Just("n1".to_string()),
        Just(String::new()),
        Just("inf".to_string()),
        Just("NaN".to_string()),
        Just("1000000000000".to_string()),
        "\\PC{0,8}",
    ]
}

fn random_lines() -> impl Strategy<Value = String> {
    prop::collection::vec(prop::collection::vec(field(), 1..5).prop_map(|f| f.join(",")), 0..12).prop_map(|l| l.join("\n"))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn bamboo_never_panics_and_returns_well_formed_traces(
        ops in prop::collection::vec((0u16..400, any::<u8>()), 0..40),
        edits in mutations(),
        lines in random_lines(),
        pick in 0u8..3,
    ) {
        let text = match pick {
            0 => bamboo_text(&ops),
            1 => mutate(&bamboo_text(&ops), &edits),
            _ => lines,
        };
        match Trace::parse_bamboo(&text, "t.csv") {
            Ok(t) => {
                check_well_formed(&t)?;
                if pick == 0 {
                    prop_assert_eq!(t.events.len(), ops.len());
                }
            }
            Err(e) => {
                prop_assert!(pick != 0 || ops.is_empty(), "a valid trace is refused: {}", e);
                check_error(&e, "t.csv")?;
            }
        }
    }

    #[test]
    fn availability_never_panics_and_returns_well_formed_traces(
        steps in prop::collection::vec((0.0f64..600.0, 0usize..12), 0..20),
        edits in mutations(),
        lines in random_lines(),
        pick in 0u8..3,
    ) {
        let mut t = 0.0;
        let valid: String = steps.iter().map(|&(dt, n)| { t += dt; format!("{t},{n}\n") }).collect();
        let text = match pick {
            0 => valid,
            1 => mutate(&valid, &edits),
            _ => lines,
        };
        match Trace::parse_availability(&text, "a.csv") {
            Ok(trace) => {
                check_well_formed(&trace)?;
                // Node names are n0, n1, …; the last line's count is what is left present.
                if pick == 0 {
                    let adds = trace.events.iter().filter(|e| e.change == Change::Add).count();
                    let removes = trace.events.len() - adds;
                    prop_assert_eq!(adds - removes, steps.last().map_or(0, |s| s.1));
                }
            }
            Err(e) => {
                prop_assert!(pick != 0 || steps.iter().all(|s| s.1 == 0), "a valid series is refused: {}", e);
                check_error(&e, "a.csv")?;
            }
        }
    }

    #[test]
    fn durations_parse_exactly_or_fail(
        x in prop_oneof![0.0f64..1e6, any::<f64>(), (0u64..1_000_000).prop_map(|x| x as f64)],
        unit in prop::sample::select(vec!["", "ms", "s", "m", "h", " h", "x", "hm"]),
        junk in "\\PC{0,12}",
        pick in 0u8..3,
    ) {
        let text = match pick {
            0 => format!("{x}{unit}"),
            1 => format!("{x:e}{unit}"),
            _ => junk,
        };
        let got = parse_duration_ms(&text);
        if pick < 2 {
            let mult = match unit.trim() { "ms" => Some(1.0), "" | "s" => Some(1e3), "m" => Some(60e3), "h" => Some(3600e3), _ => None };
            match mult {
                Some(m) if x.is_finite() && x >= 0.0 && (x * m).round() < u64::MAX as f64 => {
                    prop_assert_eq!(got.unwrap(), (x * m).round() as u64);
                }
                _ => {
                    let e = got.unwrap_err().to_string();
                    prop_assert!(e.starts_with("invalid duration: ") && e.contains(&format!("{:?}", text.trim())), "{}", e);
                }
            }
        } else if let Err(e) = got {
            prop_assert!(e.to_string().starts_with("invalid duration: "));
        }
    }

    #[test]
    fn load_traces_never_panic_and_fit_the_model(
        entries in prop::collection::vec(
            prop::collection::vec(prop::collection::vec(prop_oneof![0.0f64..100.0, -5.0f64..0.0, Just(1e308)], 0..4), 0..4),
            0..3,
        ),
        layers in 0usize..4,
        experts in 0usize..4,
        edits in mutations(),
        form in 0u8..3,
        mutated in any::<bool>(),
    ) {
        let text = match form {
            0 => serde_json::to_string(&entries).unwrap(),
            1 => serde_json::to_string(&entries.first().cloned().unwrap_or_default()).unwrap(),
            _ => entries.iter().map(|e| format!("{{\"step\": 1, \"expert_load\": {}}}\n", serde_json::to_string(e).unwrap())).collect(),
        };
        let text = if mutated { mutate(&text, &edits) } else { text };
        match LoadModel::from_trace_json(&text, layers, experts) {
            Ok(model) => {
                let LoadModel::Trace(epochs) = &model else { return Err(TestCaseError::fail("not a trace")) };
                prop_assert!(!epochs.is_empty());
                for entry in epochs {
                    prop_assert_eq!(entry.len(), layers);
                    for l in entry {
                        prop_assert_eq!(l.len(), experts);
                        prop_assert!(l.iter().all(|x| x.is_finite() && *x >= 0.0));
                    }
                }
                prop_assert!(model.validate(layers, experts).is_ok());
            }
            Err(e) => {
                let msg = e.to_string();
                prop_assert!(msg.starts_with("routing trace: "), "{}", msg);
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Any well-formed trace, cap and interval: every policy finishes, uses at most the cap, and
    /// the breakdown adds up to the duration.
    #[test]
    fn simulate_accounts_for_every_second(
        initial in 1usize..12,
        ops in prop::collection::vec((0u64..300, 0usize..14), 0..40),
        max_nodes in 1usize..14,
        minutes in 1.0f64..40.0,
        model in prop::sample::select(vec!["gpt-m", "gpt-l"]),
        wait_s in 0.0f64..200.0,
        checkpoint_every in 1u64..300,
        rebalance_every in 1u64..300,
    ) {
        // `initial` nodes at 0, then each op toggles a node (fails it or adds it) `dt` s later.
        let mut present: Vec<bool> = (0..14).map(|n| n < initial).collect();
        let mut text: String = (0..initial).map(|n| format!("0,add,n{n}\n")).collect();
        let mut t = 0;
        for &(dt, n) in &ops {
            t += dt * 1000;
            text.push_str(&format!("{t},{},n{n}\n", if present[n] { "remove" } else { "add" }));
            present[n] = !present[n];
        }
        let trace = Trace::parse_bamboo(&text, "gen").unwrap();
        let mut cost = CostModel { scale_up_wait_s: wait_s, rebalance_every, ..CostModel::default() };
        (cost.checkpoint_every_ds, cost.checkpoint_every_ds_ft, cost.checkpoint_every_lazarus) = (checkpoint_every, checkpoint_every, checkpoint_every);
        let s = Scenario { trace, model: ModelSpec::preset(model).unwrap(), cost, loads: LoadModel::default(), max_nodes, duration_s: minutes * 60.0, notices: Default::default(), mix: None, seed: 0 };
        for p in [Policy::Lazarus, Policy::Ds, Policy::DsFt] {
            let r = simulate(&s, p).unwrap();
            let total = r.breakdown.total();
            prop_assert!((total - s.duration_s).abs() < 1e-6 * s.duration_s, "{:?}: {} vs {} ({:?})", p, total, s.duration_s, r.breakdown);
            prop_assert!(r.nodes_in_use.iter().all(|&(_, n)| n <= max_nodes));
            prop_assert!(r.trained_samples >= 0.0 && r.breakdown.lost_work_s >= 0.0);
        }
    }
}
