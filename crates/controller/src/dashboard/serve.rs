//! The dashboard's three answers — the page, its state as JSON, and the stream of states a
//! browser keeps the page up to date from — and who may have them: holders of the job's status
//! token, carried in the address (`?token=…`, what `lazarus status` takes too), compared in
//! constant time. Served by the HTTP server of `metrics/server.rs`, with its limits on
//! connections (a stream lasts at most one connection's time; the browser comes back for the
//! next, as server-sent events do).

use std::sync::Mutex;
use std::time::Duration;

use hyper::body::Bytes;

use super::History;
use crate::events::TrainEvent;
use crate::service::{parse_status_token, SharedStatus};

/// Where the page is served.
pub const DASHBOARD_PATH: &str = "/dashboard";

/// The page, with everything it needs (no file or script from elsewhere).
const PAGE: &str = include_str!("page.html");
/// How often a stream looks for something new to send.
const STREAM_EVERY: Duration = Duration::from_millis(250);
/// A stream sends the state at least this often (the members' silence counts up).
const STREAM_AT_LEAST: Duration = Duration::from_secs(1);
/// How long one stream lasts: within a connection's bound; the browser then opens the next.
pub(crate) const STREAM_FOR: Duration = Duration::from_secs(5);

/// A job's dashboard: its history, the controller's published status, and the key its viewers
/// prove.
pub struct Dashboard {
    history: Mutex<History>,
    status: SharedStatus,
    key: u128,
    /// The placement drawn from the status's plan: the plan it was drawn from, how many plans
    /// have been drawn, the drawing.
    placement: Mutex<(Option<lazarus_protocol::proto::Plan>, u64, serde_json::Value)>,
}

impl Dashboard {
    /// The dashboard of the job whose status is published in `status`, for holders of `key`
    /// (the job's status key).
    pub fn new(status: SharedStatus, key: u128) -> Self {
        Dashboard { history: Mutex::new(History::default()), status, key, placement: Mutex::new((None, 0, serde_json::Value::Null)) }
    }

    /// Take in one of the job's events.
    pub fn record(&self, event: &TrainEvent) {
        let now = lazarus_protocol::when::unix_ms_now();
        self.history.lock().unwrap_or_else(|e| e.into_inner()).record(event, now);
    }

    /// Whether the request's query (`token=…`) carries the job's status token.
    pub(crate) fn admits(&self, query: Option<&str>) -> bool {
        let token = query.into_iter().flat_map(|q| q.split('&')).find_map(|kv| kv.strip_prefix("token="));
        let Some((key, _)) = token.and_then(|t| parse_status_token(&percent_decoded(t))) else { return false };
        crate::metrics::server::same(&key.to_le_bytes(), &self.key.to_le_bytes())
    }

    /// The page's state as JSON, with the history's version and the plan's it was made at;
    /// the placement left out (`null`) where the viewer has that plan's already (`has_plan`).
    pub(crate) fn state(&self, has_plan: Option<u64>) -> (String, u64, u64) {
        let status = self.status.lock().unwrap_or_else(|e| e.into_inner());
        let mut drawn = self.placement.lock().unwrap_or_else(|e| e.into_inner());
        if drawn.0 != status.plan {
            let layers: Vec<Vec<Vec<u32>>> = (status.plan.as_ref())
                .and_then(|p| lazarus_protocol::status_plan::plan_from_proto(p).ok())
                .map(|p| {
                    let map = p.replica_map();
                    (0..map.layer_count()).map(|l| map.dense_layer(l)).collect()
                })
                .unwrap_or_default();
            *drawn = (status.plan.clone(), drawn.1 + 1, super::drawn_placement(&layers));
        }
        let placement = (has_plan != Some(drawn.1)).then(|| drawn.2.clone());
        let history = self.history.lock().unwrap_or_else(|e| e.into_inner());
        (history.state(&status, placement).to_string(), history.version(), drawn.1)
    }

    /// The page, its state as of now written in (so that it shows the job at once, before its
    /// stream's first event).
    pub(crate) fn page(&self) -> String {
        // `</` in a string inside a script would end it: JSON allows `<\/`.
        PAGE.replace("/*STATE*/null", &self.state(None).0.replace("</", "<\\/"))
    }

    /// A stream of the state as server-sent events: at once, then whenever the history moves
    /// (and at least every [`STREAM_AT_LEAST`]), for [`STREAM_FOR`].
    pub(crate) fn stream(self: &std::sync::Arc<Self>) -> EventStream {
        let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(4);
        let dashboard = self.clone();
        tokio::spawn(async move {
            let until = tokio::time::Instant::now() + STREAM_FOR;
            let (mut sent_version, mut sent_at, mut plan) = (None, tokio::time::Instant::now(), None);
            let mut first = true;
            while tokio::time::Instant::now() < until {
                let version = dashboard.history.lock().unwrap_or_else(|e| e.into_inner()).version();
                if sent_version != Some(version) || sent_at.elapsed() >= STREAM_AT_LEAST {
                    let (state, version, plan_drawn) = dashboard.state(plan);
                    plan = Some(plan_drawn);
                    let retry = if first { "retry: 500\n" } else { "" };
                    if tx.send(Bytes::from(format!("{retry}data: {state}\n\n"))).await.is_err() {
                        return;
                    }
                    (sent_version, sent_at, first) = (Some(version), tokio::time::Instant::now(), false);
                }
                tokio::time::sleep(STREAM_EVERY).await;
            }
        });
        EventStream(rx)
    }
}

/// `%XX` escapes undone (a token copied through a browser may have its `:` or `+` escaped).
fn percent_decoded(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match (b[i], b.get(i + 1..i + 3).and_then(|h| std::str::from_utf8(h).ok()).and_then(|h| u8::from_str_radix(h, 16).ok())) {
            (b'%', Some(v)) => {
                out.push(v);
                i += 3;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The body of a stream of server-sent events: what the task above sends, as it comes.
pub(crate) struct EventStream(tokio::sync::mpsc::Receiver<Bytes>);

impl hyper::body::Body for EventStream {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, Self::Error>>> {
        self.0.poll_recv(cx).map(|sent| sent.map(|b| Ok(hyper::body::Frame::data(b))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn dashboard() -> Dashboard {
        let status: SharedStatus =
            Arc::new(Mutex::new(lazarus_protocol::proto::StatusReply { job_id: "job-9".into(), ..Default::default() }));
        Dashboard::new(status, 0x1234_5678_9abc_def0_1122_3344_5566_7788)
    }

    #[test]
    fn only_the_status_token_admits_and_the_page_carries_the_state() {
        let d = dashboard();
        let token =
            crate::service::status_token(0x1234_5678_9abc_def0_1122_3344_5566_7788, &lazarus_protocol::tls::ServerTls::FromSecret(5));
        assert!(d.admits(Some(&format!("token={token}"))));
        assert!(d.admits(Some(&format!("x=1&token={}", token.replace(':', "%3A")))), "escaped by a browser");
        let other =
            crate::service::status_token(0x1234_5678_9abc_def0_1122_3344_5566_7789, &lazarus_protocol::tls::ServerTls::FromSecret(5));
        for query in [None, Some(""), Some("token="), Some("token=zz"), Some(&*format!("token={other}")), Some(&*format!("tok={token}"))] {
            assert!(!d.admits(query), "{query:?}");
        }
        let page = d.page();
        assert!(page.contains("\"job_id\":\"job-9\"") && !page.contains("/*STATE*/"), "the state written in");
        assert_eq!(page.matches("http").count(), page.matches("http://www.w3.org/2000/svg").count(), "nothing from elsewhere");
    }
}
