//! Node availability over time: the Bamboo spot-trace format, availability series, and seeded
//! generators for the paper's controlled scenarios (§6.2–6.4).
//!
//! Every trace is bounded: at most [`MAX_NODES`] nodes present at once and [`MAX_EVENTS`] events,
//! so a trace built from any input is read and simulated in bounded time and memory.

use std::collections::BTreeSet;

pub use lazarus_plan::placement::MAX_NODES;
use lazarus_plan::rng::SplitMix64;
use serde::Serialize;

use crate::error::SimError;

/// Most events one trace may hold (4 Mi, ~200 MB in memory).
pub const MAX_EVENTS: usize = 1 << 22;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Change {
    Add,
    Remove,
}

/// One membership change: node `node` joins or leaves at `ms` after the start.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TraceEvent {
    pub ms: u64,
    pub change: Change,
    pub node: String,
}

/// A membership history, events in time order (ties keep file order).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Trace {
    pub events: Vec<TraceEvent>,
}

impl Trace {
    /// Bamboo's format, one `ms_offset,add|remove,node_name` per line (blank lines and `#`
    /// comments allowed). Errors name the line. Removing a node that is not present, or adding
    /// one twice, is an error too: such a trace would silently mean something else. So are more
    /// than [`MAX_NODES`] nodes present at once, more than [`MAX_EVENTS`] events, and a file
    /// without any event.
    pub fn parse_bamboo(text: &str, source_name: &str) -> Result<Self, SimError> {
        let bad = |line: usize, reason: String| SimError::Trace { source_name: source_name.to_string(), line, reason };
        let mut events = Vec::new();
        let mut present = BTreeSet::new();
        let mut last = 0u64;
        for (line, s, parts) in data_lines(text) {
            if parts.len() != 3 {
                return Err(bad(line, format!("expected ms_offset,add|remove,node_name, got {s:?}")));
            }
            let ms: u64 = parts[0].parse().map_err(|_| bad(line, format!("ms_offset {:?} is not a non-negative integer", parts[0])))?;
            if ms < last {
                return Err(bad(line, format!("ms_offset {ms} goes back in time (previous {last})")));
            }
            last = ms;
            let change = match parts[1] {
                "add" => Change::Add,
                "remove" => Change::Remove,
                other => return Err(bad(line, format!("event {other:?} is neither add nor remove"))),
            };
            let node = parts[2];
            if node.is_empty() {
                return Err(bad(line, "empty node name".into()));
            }
            let ok = match change {
                Change::Add => present.insert(node.to_string()),
                Change::Remove => present.remove(node),
            };
            if !ok {
                let why = if change == Change::Add { "is added while present" } else { "is removed while absent" };
                return Err(bad(line, format!("node {node:?} {why}")));
            }
            if present.len() > MAX_NODES {
                return Err(bad(
                    line,
                    format!("adding node {node:?} makes {} nodes present, at most {MAX_NODES} are supported", present.len()),
                ));
            }
            if events.len() == MAX_EVENTS {
                return Err(bad(line, format!("more than {MAX_EVENTS} events")));
            }
            events.push(TraceEvent { ms, change, node: node.to_string() });
        }
        if events.is_empty() {
            return Err(SimError::EmptyTrace { source_name: source_name.to_string() });
        }
        Ok(Trace { events })
    }

    /// An availability series, one `seconds,count` per line: the number of nodes from that time
    /// on. Nodes are named `n0, n1, …`; a drop removes the most recently added ones. A count
    /// above [`MAX_NODES`], more than [`MAX_EVENTS`] events in all, or no event at all (every
    /// count 0) is an error naming the line (or the file).
    pub fn parse_availability(text: &str, source_name: &str) -> Result<Self, SimError> {
        let bad = |line: usize, reason: String| SimError::Trace { source_name: source_name.to_string(), line, reason };
        let mut events = Vec::new();
        let mut present: Vec<String> = Vec::new();
        let mut next_id = 0usize;
        let mut last = 0.0f64;
        for (line, s, parts) in data_lines(text) {
            if parts.len() != 2 {
                return Err(bad(line, format!("expected seconds,count, got {s:?}")));
            }
            let secs: f64 = parts[0].parse().map_err(|_| bad(line, format!("seconds {:?} is not a number", parts[0])))?;
            if !secs.is_finite() || secs < last {
                return Err(bad(line, format!("seconds {secs} is not finite or goes back in time")));
            }
            let ms = (secs * 1000.0).round();
            if ms >= u64::MAX as f64 {
                return Err(bad(line, format!("seconds {secs} is too large (its milliseconds overflow u64)")));
            }
            last = secs;
            let count: usize = parts[1].parse().map_err(|_| bad(line, format!("count {:?} is not a non-negative integer", parts[1])))?;
            if count > MAX_NODES {
                return Err(bad(line, format!("count {count} is more than the {MAX_NODES} nodes supported")));
            }
            if events.len() + present.len().abs_diff(count) > MAX_EVENTS {
                return Err(bad(line, format!("more than {MAX_EVENTS} events")));
            }
            let ms = ms as u64;
            while present.len() < count {
                let node = format!("n{next_id}");
                next_id += 1;
                events.push(TraceEvent { ms, change: Change::Add, node: node.clone() });
                present.push(node);
            }
            while present.len() > count {
                let node = present.pop().expect("non-empty");
                events.push(TraceEvent { ms, change: Change::Remove, node });
            }
        }
        if events.is_empty() {
            return Err(SimError::EmptyTrace { source_name: source_name.to_string() });
        }
        Ok(Trace { events })
    }

    /// `nodes` nodes at time 0, then one random node fails every `every_ms` until `floor` remain.
    pub fn fail_every(nodes: usize, every_ms: u64, floor: usize, seed: u64) -> Result<Self, SimError> {
        check_nodes(nodes)?;
        if every_ms == 0 {
            return Err(SimError::invalid("fail_every", "0 ms", "the time between failures must be > 0"));
        }
        let mut events = initial(nodes);
        let mut alive: Vec<usize> = (0..nodes).collect();
        let mut rng = SplitMix64::new(seed);
        let mut t = every_ms;
        while alive.len() > floor.max(1) {
            let k = alive.remove(rng.below(alive.len()));
            events.push(TraceEvent { ms: t, change: Change::Remove, node: format!("n{k}") });
            t = t.saturating_add(every_ms);
        }
        Ok(Trace { events })
    }

    /// `nodes` nodes at time 0, then `k` random nodes fail together at `at_ms`.
    pub fn fail_at_once(nodes: usize, k: usize, at_ms: u64, seed: u64) -> Result<Self, SimError> {
        check_nodes(nodes)?;
        if k > nodes {
            return Err(SimError::invalid("fail_at_once", format!("{k} nodes"), format!("more than the {nodes} nodes there are")));
        }
        let mut events = initial(nodes);
        let mut alive: Vec<usize> = (0..nodes).collect();
        let mut rng = SplitMix64::new(seed);
        for _ in 0..k {
            let n = alive.remove(rng.below(alive.len()));
            events.push(TraceEvent { ms: at_ms, change: Change::Remove, node: format!("n{n}") });
        }
        Ok(Trace { events })
    }

    /// `nodes` nodes at time 0; each fails after an exponential time with mean `mtbf_ms` and comes
    /// back `repair_ms` later (then may fail again), until `duration_ms`. More than
    /// [`MAX_EVENTS`] events is an error.
    pub fn poisson(nodes: usize, mtbf_ms: f64, repair_ms: u64, duration_ms: u64, seed: u64) -> Result<Self, SimError> {
        check_nodes(nodes)?;
        if !mtbf_ms.is_finite() || mtbf_ms <= 0.0 {
            return Err(SimError::invalid("poisson mtbf", format!("{mtbf_ms} ms"), "must be finite and > 0"));
        }
        let too_many = || {
            SimError::invalid(
                "poisson",
                format!("{nodes} nodes, mtbf {mtbf_ms} ms, repair {repair_ms} ms over {duration_ms} ms"),
                format!("more than {MAX_EVENTS} events; use fewer nodes, a longer mtbf or a shorter duration"),
            )
        };
        // Each node fails and returns about every mtbf + repair: refuse at once what is sure to
        // be far too many, and stop generating at the bound otherwise.
        let expected = 2.0 * nodes as f64 * duration_ms as f64 / (mtbf_ms + repair_ms as f64);
        if expected > 4.0 * MAX_EVENTS as f64 {
            return Err(too_many());
        }
        let mut rng = SplitMix64::new(seed);
        let mut raw: Vec<(u64, usize, Change)> = Vec::new();
        for n in 0..nodes {
            let mut t = 0.0f64;
            loop {
                t += -mtbf_ms * (1.0 - rng.uniform()).ln();
                if t >= duration_ms as f64 {
                    break;
                }
                if nodes + raw.len() >= MAX_EVENTS {
                    return Err(too_many());
                }
                raw.push((t as u64, n, Change::Remove));
                t += repair_ms as f64;
                if t >= duration_ms as f64 {
                    break;
                }
                if nodes + raw.len() >= MAX_EVENTS {
                    return Err(too_many());
                }
                raw.push((t as u64, n, Change::Add));
            }
        }
        // Stable by time, then node: a node's remove always precedes its own re-add.
        raw.sort_by_key(|&(ms, n, c)| (ms, n, c == Change::Add));
        let mut events = initial(nodes);
        events.extend(raw.into_iter().map(|(ms, n, change)| TraceEvent { ms, change, node: format!("n{n}") }));
        Ok(Trace { events })
    }

    /// Keep [start_ms, end_ms): nodes present at `start_ms` appear as adds at 0, later events are
    /// shifted by `start_ms`.
    pub fn window(&self, start_ms: u64, end_ms: u64) -> Self {
        let mut present: Vec<String> = Vec::new();
        let mut out = Vec::new();
        for ev in &self.events {
            if ev.ms < start_ms {
                match ev.change {
                    Change::Add => present.push(ev.node.clone()),
                    Change::Remove => present.retain(|n| n != &ev.node),
                }
            } else if ev.ms < end_ms {
                if out.is_empty() {
                    out.extend(present.drain(..).map(|node| TraceEvent { ms: 0, change: Change::Add, node }));
                }
                out.push(TraceEvent { ms: ev.ms - start_ms, ..ev.clone() });
            }
        }
        if out.is_empty() {
            out.extend(present.into_iter().map(|node| TraceEvent { ms: 0, change: Change::Add, node }));
        }
        Trace { events: out }
    }

    /// Time of the last event.
    pub fn end_ms(&self) -> u64 {
        self.events.last().map_or(0, |e| e.ms)
    }

    /// What the parsers and generators guarantee, for a trace built any other way: at least one
    /// event, at most [`MAX_EVENTS`]; events in time order; a node added only while absent and
    /// removed only while present; at most [`MAX_NODES`] present at once. Errors name the event.
    pub fn validate(&self) -> Result<(), SimError> {
        let bad = |i: usize, ev: &TraceEvent, reason: String| {
            SimError::invalid("trace", format!("event {i} ({} ms, {:?} {:?})", ev.ms, ev.change, ev.node), reason)
        };
        if self.events.is_empty() {
            return Err(SimError::invalid("trace", "0 events", "the trace holds no events"));
        }
        if self.events.len() > MAX_EVENTS {
            return Err(SimError::invalid("trace", format!("{} events", self.events.len()), format!("at most {MAX_EVENTS} are supported")));
        }
        let mut present: BTreeSet<&str> = BTreeSet::new();
        let mut last = 0u64;
        for (i, ev) in self.events.iter().enumerate() {
            if ev.ms < last {
                return Err(bad(i, ev, format!("goes back in time (previous {last} ms)")));
            }
            last = ev.ms;
            let ok = match ev.change {
                Change::Add => present.insert(&ev.node),
                Change::Remove => present.remove(ev.node.as_str()),
            };
            if !ok {
                let why = if ev.change == Change::Add { "the node is added while present" } else { "the node is removed while absent" };
                return Err(bad(i, ev, why.into()));
            }
            if present.len() > MAX_NODES {
                return Err(bad(i, ev, format!("{} nodes present, at most {MAX_NODES} are supported", present.len())));
            }
        }
        Ok(())
    }
}

/// A generator's node count: 1 to [`MAX_NODES`].
fn check_nodes(nodes: usize) -> Result<(), SimError> {
    if nodes == 0 || nodes > MAX_NODES {
        return Err(SimError::invalid("nodes", nodes, format!("must be 1 to {MAX_NODES}")));
    }
    Ok(())
}

/// (1-based line number, trimmed line, comma-separated fields) of every line that is neither
/// blank nor a `#` comment.
fn data_lines(text: &str) -> impl Iterator<Item = (usize, &str, Vec<&str>)> {
    text.lines().enumerate().filter_map(|(i, raw)| {
        let s = raw.trim();
        (!s.is_empty() && !s.starts_with('#')).then(|| (i + 1, s, s.split(',').map(str::trim).collect()))
    })
}

fn initial(nodes: usize) -> Vec<TraceEvent> {
    (0..nodes).map(|n| TraceEvent { ms: 0, change: Change::Add, node: format!("n{n}") }).collect()
}

/// Parse a duration like `90`, `90s`, `5m`, `2h`, `1500ms` into milliseconds. A negative, not
/// finite or too large value (its milliseconds overflow u64) is an error naming it.
pub fn parse_duration_ms(s: &str) -> Result<u64, SimError> {
    let s = s.trim();
    let (num, mult) = if let Some(v) = s.strip_suffix("ms") {
        (v, 1.0)
    } else if let Some(v) = s.strip_suffix('s') {
        (v, 1e3)
    } else if let Some(v) = s.strip_suffix('m') {
        (v, 60e3)
    } else if let Some(v) = s.strip_suffix('h') {
        (v, 3600e3)
    } else {
        (s, 1e3)
    };
    let x: f64 = num
        .trim()
        .parse()
        .map_err(|_| SimError::invalid("duration", format!("{s:?}"), "expected a number with an optional unit ms, s, m or h"))?;
    if !x.is_finite() {
        return Err(SimError::invalid("duration", format!("{s:?}"), "must be finite"));
    }
    if x < 0.0 {
        return Err(SimError::invalid("duration", format!("{s:?}"), "must be ≥ 0"));
    }
    let ms = (x * mult).round();
    // u64::MAX as f64 is 2^64, the first value that does not fit.
    if ms >= u64::MAX as f64 {
        return Err(SimError::invalid("duration", format!("{s:?}"), "too large: its milliseconds overflow u64"));
    }
    Ok(ms as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bamboo_parses_and_names_the_bad_line() {
        let t = Trace::parse_bamboo("0,add,a\n0,add,b\n# c\n\n60000,remove,a\n", "t.csv").unwrap();
        assert_eq!(t.events.len(), 3);
        assert_eq!(t.events[2], TraceEvent { ms: 60000, change: Change::Remove, node: "a".into() });
        for (text, line, what) in [
            ("0,add,a\n5,drop,a\n", 2, "neither add nor remove"),
            ("0,add,a\nx,remove,a\n", 2, "not a non-negative integer"),
            ("0,add,a\n0,add,b\n10,remove,c\n", 3, "removed while absent"),
            ("10,add,a\n5,add,b\n", 2, "back in time"),
            ("0,add\n", 1, "expected"),
        ] {
            let e = Trace::parse_bamboo(text, "t.csv").unwrap_err().to_string();
            assert!(e.contains(&format!("line {line}")) && e.contains(what), "{e}");
        }
    }

    #[test]
    fn availability_series_becomes_adds_and_removes() {
        let t = Trace::parse_availability("0,3\n60,1\n120,2\n", "a.csv").unwrap();
        let removes = t.events.iter().filter(|e| e.change == Change::Remove).count();
        assert_eq!((t.events.len(), removes), (6, 2));
        assert!(Trace::parse_availability("0,3\n60,-1\n", "a.csv").unwrap_err().to_string().contains("line 2"));
    }

    #[test]
    fn generators_follow_their_definition() {
        let t = Trace::fail_every(10, 300_000, 5, 1).unwrap();
        let removes: Vec<u64> = t.events.iter().filter(|e| e.change == Change::Remove).map(|e| e.ms).collect();
        assert_eq!(removes, vec![300_000, 600_000, 900_000, 1_200_000, 1_500_000]);
        let t = Trace::fail_at_once(10, 4, 1000, 2).unwrap();
        assert_eq!(t.events.iter().filter(|e| e.change == Change::Remove && e.ms == 1000).count(), 4);
        let t = Trace::poisson(50, 600_000.0, 60_000, 3_600_000, 3).unwrap();
        let fails = t.events.iter().filter(|e| e.change == Change::Remove).count();
        // 50 nodes × 1 h / (10 min + 1 min repair) ≈ 270 failures.
        assert!((180..360).contains(&fails), "{fails}");
        // Replays cleanly through the strict parser's rules.
        let text: String =
            t.events.iter().map(|e| format!("{},{},{}\n", e.ms, if e.change == Change::Add { "add" } else { "remove" }, e.node)).collect();
        Trace::parse_bamboo(&text, "gen").unwrap();
    }

    #[test]
    fn window_starts_with_the_nodes_present() {
        let t = Trace::parse_bamboo("0,add,a\n0,add,b\n100,remove,a\n200,add,c\n300,remove,b\n", "t").unwrap();
        let w = t.window(150, 250);
        assert_eq!(
            w.events,
            vec![TraceEvent { ms: 0, change: Change::Add, node: "b".into() }, TraceEvent { ms: 50, change: Change::Add, node: "c".into() },]
        );
        assert_eq!(parse_duration_ms("5m").unwrap(), 300_000);
        assert_eq!(parse_duration_ms("1500ms").unwrap(), 1500);
        assert!(parse_duration_ms("five").is_err());
    }

    fn err<T: std::fmt::Debug>(r: Result<T, SimError>) -> String {
        r.unwrap_err().to_string()
    }

    #[test]
    fn availability_counts_are_bounded() {
        let e = err(Trace::parse_availability("0,3\n60,1000000000000\n", "a.csv"));
        assert!(e.contains("a.csv line 2") && e.contains("count 1000000000000") && e.contains("10000"), "{e}");
        let e = err(Trace::parse_availability("0,10001\n", "a.csv"));
        assert!(e.contains("line 1") && e.contains("10001"), "{e}");
        assert_eq!(Trace::parse_availability("0,10000\n", "a.csv").unwrap().events.len(), MAX_NODES);
        let e = err(Trace::parse_availability("0,1\n1e300,0\n", "a.csv"));
        assert!(e.contains("line 2") && e.contains("overflow"), "{e}");
    }

    #[test]
    fn bamboo_presence_is_bounded() {
        let text: String = (0..=MAX_NODES).map(|n| format!("0,add,n{n}\n")).collect();
        let e = err(Trace::parse_bamboo(&text, "t.csv"));
        assert!(e.contains(&format!("line {}", MAX_NODES + 1)) && e.contains("10001 nodes present"), "{e}");
    }

    #[test]
    fn a_trace_without_events_is_an_error() {
        assert_eq!(err(Trace::parse_bamboo("# nothing\n\n", "t.csv")), "t.csv: the trace holds no events");
        assert_eq!(err(Trace::parse_availability("0,0\n60,0\n", "a.csv")), "a.csv: the trace holds no events");
        assert_eq!(err(Trace::parse_availability("", "a.csv")), "a.csv: the trace holds no events");
        assert!(err(Trace::default().validate()).contains("the trace holds no events"));
    }

    #[test]
    fn generators_refuse_what_they_cannot_bound() {
        for e in [
            err(Trace::fail_every(10_000_000, 60_000, 5, 1)),
            err(Trace::fail_at_once(10_000_000, 4, 60_000, 1)),
            err(Trace::poisson(10_000_000, 1e6, 60_000, 3_600_000, 1)),
        ] {
            assert_eq!(e, "invalid nodes: 10000000 (must be 1 to 10000)");
        }
        assert!(err(Trace::fail_every(0, 60_000, 0, 1)).contains("invalid nodes: 0"));
        assert!(err(Trace::fail_every(10, 0, 5, 1)).contains("fail_every"));
        let e = err(Trace::fail_at_once(10, 11, 60_000, 1));
        assert!(e.contains("11 nodes") && e.contains("10 nodes"), "{e}");
        for mtbf in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert!(err(Trace::poisson(10, mtbf, 0, 3_600_000, 1)).contains("poisson mtbf"), "{mtbf}");
        }
        // 10^4 nodes failing every second for a month: refused at once.
        let e = err(Trace::poisson(10_000, 1000.0, 0, 2_592_000_000, 1));
        assert!(e.contains("invalid poisson") && e.contains(&format!("more than {MAX_EVENTS} events")), "{e}");
        // Near the bound, the count while generating decides.
        let e = err(Trace::poisson(10_000, 100_000.0, 0, 60_000_000, 1));
        assert!(e.contains(&format!("more than {MAX_EVENTS} events")), "{e}");
        // Failures far apart never overflow the clock.
        let t = Trace::fail_every(4, u64::MAX / 2, 1, 1).unwrap();
        t.validate().unwrap();
        assert_eq!(t.end_ms(), u64::MAX);
    }

    #[test]
    fn durations_are_finite_and_fit_u64_milliseconds() {
        for (s, what) in [
            ("1e14h", "overflow"),
            ("18446744073709551616ms", "overflow"),
            ("inf", "finite"),
            ("NaN", "finite"),
            ("-5m", "≥ 0"),
            ("", "expected a number"),
            ("5x", "expected a number"),
        ] {
            let e = err(parse_duration_ms(s));
            assert!(e.contains(&format!("{s:?}")) && e.contains(what), "{s}: {e}");
        }
        assert_eq!(parse_duration_ms("1e12h").unwrap(), 3_600_000_000_000_000_000);
        assert_eq!(parse_duration_ms("0").unwrap(), 0);
    }

    #[test]
    fn validate_names_the_bad_event() {
        let ev = |ms, change, node: &str| TraceEvent { ms, change, node: node.into() };
        let cases = [
            (vec![ev(0, Change::Add, "a"), ev(10, Change::Add, "b"), ev(5, Change::Remove, "a")], "event 2", "back in time"),
            (vec![ev(0, Change::Add, "a"), ev(0, Change::Add, "a")], "event 1", "added while present"),
            (vec![ev(0, Change::Add, "a"), ev(1, Change::Remove, "b")], "event 1", "removed while absent"),
        ];
        for (events, which, what) in cases {
            let e = err(Trace { events }.validate());
            assert!(e.starts_with("invalid trace: ") && e.contains(which) && e.contains(what), "{e}");
        }
        let many = Trace { events: (0..=MAX_NODES).map(|n| ev(0, Change::Add, &format!("n{n}"))).collect() };
        assert!(err(many.validate()).contains("10001 nodes present"));
    }
}
