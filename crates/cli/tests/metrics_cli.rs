//! A real Prometheus server (Debian's `prometheus`, which `.ci/run` installs) scrapes a live job
//! at `--metrics-listen` with the job's bearer token (`--metrics-token-file`, Prometheus's
//! `credentials_file`), and its query API answers with the job's step. Without the server the
//! test says so and checks the endpoint alone.

mod common;

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use common::{dir, spawn_lazarus};

/// The token the job's scrapes carry.
const TOKEN: &str = "d1f0e5a7c3b9428e8a61f2c4b7d09e35";

/// `GET path` from `addr` over HTTP/1.1 (with the job's bearer token): the status line and the
/// body.
fn get(addr: &str, path: &str) -> Option<(String, String)> {
    get_with(addr, path, &format!("Authorization: Bearer {TOKEN}\r\n"))
}

/// The same with `headers` (each ending in CRLF).
fn get_with(addr: &str, path: &str, headers: &str) -> Option<(String, String)> {
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\n{headers}Connection: close\r\n\r\n").ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let (head, body) = text.split_once("\r\n\r\n")?;
    Some((head.lines().next()?.to_string(), body.to_string()))
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

#[test]
fn prometheus_scrapes_a_live_job() {
    let d = dir("metrics");
    let token_file = d.join("token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();
    let token_s = token_file.to_str().unwrap().to_string();
    let mut args =
        vec!["train", "--workers", "2", "--steps", "100000", "--metrics-listen", "127.0.0.1:0", "--metrics-token-file", &token_s];
    args.extend(common::tiny_model("4"));
    let (mut job, lines) = spawn_lazarus(&args, &[]);
    let deadline = Instant::now() + Duration::from_secs(60);
    let addr = loop {
        let line = lines.recv_timeout(deadline.saturating_duration_since(Instant::now())).expect("the job serves its metrics");
        if let Some(rest) = line.split("metrics for Prometheus: http://").nth(1) {
            break rest.trim_end_matches("/metrics").to_string();
        }
    };
    // The endpoint itself: the text format, the job's members, a 404 elsewhere.
    let body = loop {
        let (status, body) = get(&addr, "/metrics").expect("the endpoint answers");
        assert!(status.contains("200"), "{status}");
        if body.contains("lazarus_members{state=\"member\"} 2") && !body.contains("lazarus_step 0") {
            break body;
        }
        assert!(Instant::now() < deadline, "{body}");
        std::thread::sleep(Duration::from_millis(100));
    };
    for name in ["lazarus_loss", "lazarus_tokens_per_second", "lazarus_epoch 0", "lazarus_checkpoint_age_seconds", "# EOF"] {
        assert!(body.contains(name), "{name} in\n{body}");
    }
    assert!(get(&addr, "/other").unwrap().0.contains("404"));
    // Without the token, or with another: refused.
    assert!(get_with(&addr, "/metrics", "").unwrap().0.contains("401"));
    assert!(get_with(&addr, "/metrics", "Authorization: Bearer d1f0e5a7c3b9428e8a61f2c4b7d09e36\r\n").unwrap().0.contains("401"));
    // Silent connections do not hold a scrape up (each connection is served on its own).
    let silent: Vec<std::net::TcpStream> = (0..50).filter_map(|_| std::net::TcpStream::connect(&addr).ok()).collect();
    assert!(get(&addr, "/metrics").unwrap().0.contains("200"), "a scrape beside {} silent connections", silent.len());
    drop(silent);
    match std::process::Command::new("prometheus").arg("--version").output() {
        Err(_) => eprintln!("skipped the Prometheus server part: `prometheus` is not installed (apt-get install prometheus)"),
        Ok(_) => {
            let config = d.join("prometheus.yml");
            std::fs::write(
                &config,
                format!(
                    "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: lazarus\n    authorization:\n      credentials_file: {token_s}\n    static_configs:\n      - targets: ['{addr}']\n"
                ),
            )
            .unwrap();
            let web = format!("127.0.0.1:{}", free_port());
            let mut server = std::process::Command::new("prometheus")
                .args([
                    &format!("--config.file={}", config.display()),
                    &format!("--storage.tsdb.path={}", d.join("tsdb").display()),
                    &format!("--web.listen-address={web}"),
                ])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap();
            let until = Instant::now() + Duration::from_secs(60);
            let step = loop {
                if let Some((_, body)) = get(&web, "/api/v1/query?query=lazarus_step") {
                    let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
                    if let Some(x) = v["data"]["result"][0]["value"][1].as_str() {
                        break x.parse::<f64>().unwrap();
                    }
                }
                assert!(Instant::now() < until, "Prometheus never had lazarus_step");
                std::thread::sleep(Duration::from_millis(250));
            };
            assert!(step >= 1.0, "the step Prometheus scraped: {step}");
            let _ = server.kill();
            let _ = server.wait();
        }
    }
    let _ = job.kill();
    let _ = job.wait();
}
