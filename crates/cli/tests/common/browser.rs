//! A real browser for the tests of the pages Lazarus makes: Debian's chromium, headless. Where
//! it is not installed the tests that use it say so and check what they can without it.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The chromium on the PATH, if any (`.ci/run` installs Debian's).
pub fn chromium() -> Option<PathBuf> {
    let found = ["chromium", "chromium-browser", "google-chrome"].into_iter().find_map(|name| {
        let out = Command::new("sh").args(["-c", &format!("command -v {name}")]).output().ok()?;
        out.status.success().then(|| PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
    });
    if found.is_none() {
        eprintln!("chromium is not installed: the page is checked without a browser");
    }
    found
}

/// What a browser made of the page at `url`: the DOM it built, and the console messages the
/// page logged (errors included) — and, with `screenshot`, a picture of it there.
pub struct Loaded {
    pub dom: String,
    pub console: Vec<String>,
}

/// `url` loaded headless by `chrome` (its own profile under `scratch`), with a screenshot
/// `width` x `height` written to `screenshot` if given.
pub fn load(chrome: &Path, url: &str, scratch: &Path, screenshot: Option<(&Path, u32, u32)>) -> Loaded {
    let base = |cmd: &mut Command| {
        // The DOM is read (or the picture taken) once the page has had 400 ms of its own time:
        // its scripts have run and a stream it opened has delivered (its time stands still while
        // a stream is open: a load lasts as long as the page's first stream).
        cmd.args(["--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0", "--virtual-time-budget=400"])
            .arg(format!("--user-data-dir={}", scratch.join("chromium-profile").display()));
    };
    let out = headless(&format!("chromium --dump-dom {url}"), || {
        let mut dump = Command::new(chrome);
        base(&mut dump);
        dump.args(["--dump-dom", url]);
        dump
    });
    assert!(out.status.success(), "chromium: {}", String::from_utf8_lossy(&out.stderr));
    let console = String::from_utf8_lossy(&out.stderr).lines().filter(|l| l.contains(":CONSOLE")).map(str::to_string).collect();
    if let Some((path, w, h)) = screenshot {
        let out = headless("chromium --screenshot", || {
            let mut shot = Command::new(chrome);
            base(&mut shot);
            shot.arg(format!("--screenshot={}", path.display())).arg(format!("--window-size={w},{h}")).arg(url);
            shot
        });
        assert!(out.status.success() && path.exists(), "chromium: {}", String::from_utf8_lossy(&out.stderr));
    }
    Loaded { dom: String::from_utf8_lossy(&out.stdout).into_owned(), console }
}

/// What a headless chromium run of `cmd()` printed. Chromium now and then never ends a load
/// whose page holds a stream open (its virtual time waits on it): such a run is killed after
/// two minutes and made again, three times at most, before the test fails naming it.
fn headless(what: &str, cmd: impl Fn() -> Command) -> std::process::Output {
    const TRIES: u32 = 3;
    let limit = std::time::Duration::from_secs(120);
    for attempt in 1..=TRIES {
        match super::output_or_stderr(cmd(), limit) {
            Ok(out) => return out,
            Err(err) if attempt == TRIES => panic!("`{what}` ran past {} s {TRIES} times (killed). Its stderr:\n{err}", limit.as_secs()),
            Err(_) => eprintln!("`{what}` ran past {} s: killed, made again", limit.as_secs()),
        }
    }
    unreachable!("the last try returns or panics")
}
