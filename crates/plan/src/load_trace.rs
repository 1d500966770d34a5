//! Routing traces: per-layer expert loads recorded from a run (the paper replays SmartMoE's
//! trace for reproducible experiments). One parser for the trainer's trace-driven routing and
//! the simulator's load model.

use crate::error::PlanError;

/// Parse `[[loads per expert] per layer]` (one entry) or a list of those, checking every entry
/// against the model's `layers` and `experts` and every load for being finite and ≥ 0.
pub fn parse_load_trace(text: &str, layers: usize, experts: usize) -> Result<Vec<Vec<Vec<f64>>>, PlanError> {
    let bad = |reason: String| PlanError::invalid("routing trace", "file", reason);
    let value: serde_json::Value = serde_json::from_str(text).map_err(|e| bad(format!("not valid JSON: {e}")))?;
    let entries: Vec<Vec<Vec<f64>>> = if value.pointer("/0/0/0").is_some() {
        serde_json::from_value(value).map_err(|e| bad(format!("expected [[[loads]]]: {e}")))?
    } else {
        vec![serde_json::from_value(value).map_err(|e| bad(format!("expected [[loads per expert] per layer]: {e}")))?]
    };
    if entries.is_empty() {
        return Err(bad("holds no entries".into()));
    }
    for (k, entry) in entries.iter().enumerate() {
        if entry.len() != layers {
            return Err(bad(format!("entry {k} has {} layers, the model has {layers} MoE layers", entry.len())));
        }
        for (l, loads) in entry.iter().enumerate() {
            if loads.len() != experts {
                return Err(bad(format!("entry {k} layer {l} has {} loads, the model has {experts} experts", loads.len())));
            }
            if let Some(x) = loads.iter().find(|x| !x.is_finite() || **x < 0.0) {
                return Err(bad(format!("entry {k} layer {l}: load {x} is not finite and ≥ 0")));
            }
        }
    }
    Ok(entries)
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
}
