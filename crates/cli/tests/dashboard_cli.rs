//! The live dashboard of a job on workers (`--dashboard-listen`), as a browser sees it: the page
//! loads in headless chromium with no console message and the job's workers on it, updates
//! itself from its stream, shows a worker SIGKILLed from outside on its timeline with the
//! recovery, and is refused to whoever lacks the job's status token.

mod common;

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use common::{signal, spawn_lazarus, tiny_model, wait, worker_pids};

/// `GET path` on `addr`, the whole answer (the server closes after one).
fn get(addr: &str, path: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes()).unwrap();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

/// The JSON body of an answer.
fn json_of(answer: &str) -> serde_json::Value {
    serde_json::from_str(answer.split("\r\n\r\n").nth(1).unwrap_or("")).unwrap_or_default()
}

/// Read the event stream at `path` (opening it again as each one ends) until an event's data
/// satisfies `want`; that event's data.
fn stream_until(addr: &str, path: &str, within: Duration, want: impl Fn(&serde_json::Value) -> bool) -> serde_json::Value {
    let until = Instant::now() + within;
    let mut seen = 0;
    while Instant::now() < until {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_millis(500))).unwrap();
        s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes()).unwrap();
        let (mut buf, mut chunk) = (String::new(), [0u8; 65536]);
        loop {
            match s.read(&mut chunk) {
                Ok(0) => break,
                Ok(n) => buf.push_str(&String::from_utf8_lossy(&chunk[..n])),
                Err(_) if Instant::now() < until => {}
                Err(_) => break,
            }
            // Events are `data: JSON` lines; the chunked framing's size lines come between.
            while let Some(i) = buf.find("data: ") {
                let Some(end) = buf[i..].find('\n') else { break };
                let v: serde_json::Value = serde_json::from_str(&buf[i + 6..i + end]).unwrap_or_default();
                buf.drain(..i + end);
                seen += 1;
                if want(&v) {
                    return v;
                }
            }
        }
    }
    panic!("{path}: no event of the {seen} seen within {within:?} was the one waited for")
}

#[test]
fn the_dashboard_shows_the_job_live_and_a_killed_worker_on_its_timeline() {
    let d = common::dir("dashboard");
    let mut args = vec!["train", "--steps", "100000", "--workers", "3", "--no-save", "--dashboard-listen", "127.0.0.1:0"];
    args.extend(tiny_model("3"));
    // Paced: the job runs until the test stops it.
    let (mut child, lines) = spawn_lazarus(&args, &[("LAZARUS_FAULT", "pace:40")]);
    let mut seen = Vec::new();
    let line = wait::line(&lines, "the dashboard's address", Duration::from_secs(120), &mut seen, |l| l.contains("dashboard: http://"));
    let url = line.split("dashboard: ").nth(1).unwrap().trim().to_string();
    let rest = url.strip_prefix("http://").unwrap();
    let (addr, path) = rest.split_at(rest.find('/').unwrap());
    let query = path.split_once('?').unwrap().1.to_string();
    eprintln!("dashboard at {url}");
    let pids = worker_pids(&lines, 3, |_| {});
    // Nobody without the job's status token.
    let token = query.strip_prefix("token=").unwrap();
    // Another key (the token's first digit changed), its pin kept.
    let wrong = format!("{}{}", if token.starts_with('0') { '1' } else { '0' }, &token[1..]);
    for p in ["/dashboard", "/dashboard?token=", &format!("/dashboard/state?token={wrong}"), "/dashboard/events", "/dashboard/state"] {
        let got = get(addr, p);
        assert!(got.starts_with("HTTP/1.1 401"), "{p}: {got}");
    }
    assert!(get(addr, "/metrics").starts_with("HTTP/1.1 404"), "the dashboard's server serves only it");
    let state = |answer: String| json_of(&answer);
    wait::until("a few steps on the dashboard", Duration::from_secs(120), || {
        let s = state(get(addr, &format!("/dashboard/state?{query}")));
        if s["loss"].as_array().is_some_and(|l| l.len() >= 3) {
            Ok(())
        } else {
            Err(s.to_string())
        }
    });
    let s = state(get(addr, &format!("/dashboard/state?{query}")));
    assert_eq!(s["members"].as_array().unwrap().len(), 3, "{s}");
    assert!(s["placement"][0]["replicas"].as_array().is_some_and(|e| e.len() == 4), "4 experts placed: {s}");
    let chrome = common::browser::chromium();
    if let Some(chrome) = &chrome {
        let page = common::browser::load(chrome, &url, &d, None);
        assert!(page.console.is_empty(), "the page logged: {:?}", page.console);
        assert_eq!(page.dom.matches("<tr class=\"member\"").count(), 3, "three members on the page");
        let updates: u32 =
            page.dom.split("data-updates=\"").nth(1).and_then(|r| r.split('"').next()).and_then(|n| n.parse().ok()).unwrap_or(0);
        assert!(updates >= 1, "the page took its stream's events");
    }
    // Worker 1 SIGKILLed from outside: the stream, open as it happens, brings the loss and the
    // recovery to the timeline.
    let killed = Instant::now();
    signal(pids[1], libc::SIGKILL);
    let recovered = stream_until(addr, &format!("/dashboard/events?{query}"), Duration::from_secs(60), |v| {
        v["timeline"].as_array().is_some_and(|t| t.iter().any(|e| e["kind"] == "reconfigure"))
    });
    let took = killed.elapsed();
    let timeline = recovered["timeline"].as_array().unwrap();
    let lost = timeline.iter().find(|e| e["kind"] == "lost").expect("the loss on the timeline");
    assert!(lost["text"].as_str().unwrap().contains("worker 1"), "{lost}");
    let r = timeline.iter().find(|e| e["kind"] == "reconfigure").unwrap();
    assert!(r["cost_s"].as_f64().is_some_and(|c| c > 0.0), "the recovery with its time: {r}");
    eprintln!("kill → recovery on the dashboard's stream: {took:?}");
    if let Some(chrome) = &chrome {
        let shot = common::runs_dir().with_file_name("dashboard-after-a-worker-was-killed.png");
        let page = common::browser::load(chrome, &url, &d, Some((&shot, 1150, 1500)));
        assert!(page.console.is_empty(), "the page logged: {:?}", page.console);
        assert!(page.dom.contains("<li class=\"reconfigure\">") && page.dom.contains("<li class=\"lost\">"), "on the page's timeline");
        assert_eq!(page.dom.matches("<tr class=\"member\"").count(), 2, "two members after the loss");
    }
    eprintln!("pages checked after {:?}", killed.elapsed());
    signal(child.id() as i32, libc::SIGTERM);
    wait::exit(&mut child, &lines, "the job, stopped", Duration::from_secs(60));
    eprintln!("stopped after {:?}", killed.elapsed());
}
