//! Routing traces: per-layer expert loads recorded from a run (the paper replays SmartMoE's
//! trace for reproducible experiments). One parser for the trainer's trace-driven routing and
//! the simulator's load model.

use crate::error::PlanError;

/// Parse `[[loads per expert] per layer]` (one entry), a list of those, or a trainer's
/// `--json-log` (one JSON object per line whose `expert_load` is an entry), checking every entry
/// against the model's `layers` and `experts` and every load for being finite and ≥ 0.
pub fn parse_load_trace(text: &str, layers: usize, experts: usize) -> Result<Vec<Vec<Vec<f64>>>, PlanError> {
    let bad = |reason: String| PlanError::invalid("routing trace", "file", reason);
    let entries: Vec<Vec<Vec<f64>>> = if text.trim_start().starts_with('{') {
        let mut entries = Vec::new();
        for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
            let v: serde_json::Value = serde_json::from_str(line).map_err(|e| bad(format!("line {}: not valid JSON: {e}", i + 1)))?;
            let load = v.get("expert_load").ok_or_else(|| bad(format!("line {}: no \"expert_load\" field", i + 1)))?;
            entries.push(
                serde_json::from_value(load.clone())
                    .map_err(|e| bad(format!("line {}: expert_load: expected [[loads per expert] per layer]: {e}", i + 1)))?,
            );
        }
        entries
    } else {
        parse_json_entries(text).map_err(bad)?
    };
    check_entries(&entries, layers, experts).map_err(bad)?;
    Ok(entries)
}

fn parse_json_entries(text: &str) -> Result<Vec<Vec<Vec<f64>>>, String> {
    let value: serde_json::Value = serde_json::from_str(text).map_err(|e| format!("not valid JSON: {e}"))?;
    Ok(if value.pointer("/0/0/0").is_some() {
        serde_json::from_value(value).map_err(|e| format!("expected [[[loads]]]: {e}"))?
    } else {
        vec![serde_json::from_value(value).map_err(|e| format!("expected [[loads per expert] per layer]: {e}"))?]
    })
}

fn check_entries(entries: &[Vec<Vec<f64>>], layers: usize, experts: usize) -> Result<(), String> {
    if entries.is_empty() {
        return Err("holds no entries".into());
    }
    for (k, entry) in entries.iter().enumerate() {
        if entry.len() != layers {
            return Err(format!("entry {k} has {} layers, the model has {layers} MoE layers", entry.len()));
        }
        for (l, loads) in entry.iter().enumerate() {
            if loads.len() != experts {
                return Err(format!("entry {k} layer {l} has {} loads, the model has {experts} experts", loads.len()));
            }
            if let Some(x) = loads.iter().find(|x| !x.is_finite() || **x < 0.0) {
                return Err(format!("entry {k} layer {l}: load {x} is not finite and ≥ 0"));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_entry_or_many_and_clear_errors() {
        assert_eq!(parse_load_trace("[[1,2],[3,4]]", 2, 2).unwrap().len(), 1);
        assert_eq!(parse_load_trace("[[[1,2]],[[3,4]]]", 1, 2).unwrap().len(), 2);
        for (text, expect) in [("[[1,2]]", "1 layers"), ("[[1,-2],[3,4]]", "-2"), ("[[1],[3,4]]", "1 loads"), ("{", "not valid JSON")] {
            let e = parse_load_trace(text, 2, 2).unwrap_err().to_string();
            assert!(e.contains(expect), "{text}: {e}");
        }
    }

    #[test]
    fn a_trainer_json_log_is_a_trace() {
        let log = "{\"step\":1,\"loss\":5.1,\"expert_load\":[[3,1],[2,2]]}\n\n{\"step\":2,\"loss\":4.9,\"expert_load\":[[4,0],[1,3]]}\n";
        let t = parse_load_trace(log, 2, 2).unwrap();
        assert_eq!(t, vec![vec![vec![3.0, 1.0], vec![2.0, 2.0]], vec![vec![4.0, 0.0], vec![1.0, 3.0]]]);
        let e = parse_load_trace("{\"step\":1,\"expert_load\":[[1,2]]}\n{\"step\":2}", 1, 2).unwrap_err().to_string();
        assert!(e.contains("line 2") && e.contains("expert_load"), "{e}");
        let e = parse_load_trace("{\"expert_load\":[[1,2,3]]}", 1, 2).unwrap_err().to_string();
        assert!(e.contains("3 loads"), "{e}");
    }
}

#[cfg(test)]
mod fuzz {
    use proptest::prelude::*;

    use super::parse_load_trace;

    const GOOD: &str = "[[[1, 2, 3], [4, 5, 6]], [[0, 0, 1], [2.5, 1e3, 7]]]";
    const LOG: &str = "{\"step\":1,\"expert_load\":[[1,2,3],[4,5,6]]}\n{\"step\":2,\"expert_load\":[[3,2,1],[6,5,4]]}\n";

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]
        /// Damaged traces (both forms) are an error or a well-formed trace, never a panic.
        #[test]
        fn damaged_traces_never_panic(log in any::<bool>(), edits in proptest::collection::vec((0usize..120, any::<u8>()), 1..5), cut in 0usize..120) {
            let mut text = if log { LOG } else { GOOD }.as_bytes().to_vec();
            for (pos, byte) in edits {
                if pos < text.len() {
                    text[pos] = byte;
                }
            }
            text.truncate(cut.max(1).min(text.len()));
            if let Ok(s) = std::str::from_utf8(&text) {
                if let Ok(t) = parse_load_trace(s, 2, 3) {
                    prop_assert!(!t.is_empty());
                    for entry in &t {
                        prop_assert_eq!(entry.len(), 2);
                        prop_assert!(entry.iter().all(|l| l.len() == 3 && l.iter().all(|x| x.is_finite() && *x >= 0.0)));
                    }
                }
            }
        }
    }
}
