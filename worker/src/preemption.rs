//! A cloud's preemption notice, read from its instance metadata server: an elastic worker
//! started with `HVD_PREEMPTION_WATCH` (`horovodrun --preemption-watch`, or an `hvd-agent` with
//! the flag) polls it and, at a notice, tells the driver its host is going away
//! ([`WorkerMsg::Notice`]), which takes the host out gracefully. Each cloud is read at the
//! documented path with the documented headers:
//!
//! - AWS: an IMDSv2 session token (`PUT /latest/api/token`), then
//!   `/latest/meta-data/spot/instance-action` (404 until a stop or termination is two minutes
//!   away) and the earlier `/latest/meta-data/events/recommendations/rebalance`;
//! - GCE and GKE: `/computeMetadata/v1/instance/preempted` with `Metadata-Flavor: Google`
//!   (`TRUE` about 30 s before the shutdown), answered with the same header;
//! - Azure: Scheduled Events (`/metadata/scheduledevents`, `Metadata: true`), an event of type
//!   `Preempt` for this VM, which happens at its `NotBefore`.
//!
//! A metadata server that cannot be read (down, garbage, an unexpected status) is logged once
//! and polled again: it is never taken for a notice.

use std::thread;
use std::time::{Duration, Instant, SystemTime};

use hvd_rendezvous::{Cloud, WorkerMsg};

/// Where all three clouds serve instance metadata.
pub(crate) const METADATA_DEFAULT: &str = "http://169.254.169.254";
/// How often the notice is read unless `HVD_PREEMPTION_POLL` says otherwise.
pub(crate) const POLL_DEFAULT: Duration = Duration::from_secs(2);
/// The longest a read may take: the server is on the host's own link.
const READ_TIMEOUT: Duration = Duration::from_secs(2);
/// GCE shuts a preempted VM down about 30 s after `preempted` turns `TRUE`.
const GCE_NOTICE: Duration = Duration::from_secs(30);
/// How long an IMDSv2 token lives (six hours, the longest AWS allows); renewed before.
const AWS_TOKEN_TTL: Duration = Duration::from_secs(6 * 3600);

/// What one read of the metadata says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Reading {
    /// No notice.
    Quiet,
    /// The host is going away.
    Notice {
        /// How long it has left, where the notice says.
        within: Option<Duration>,
        /// What the cloud said, for the log.
        what: String,
    },
}

/// Why the metadata could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum MetadataError {
    /// No answer: the server is down, or this is not that cloud.
    #[error("{url}: no answer: {detail}")]
    Unreachable {
        /// What was asked.
        url: String,
        /// Why.
        detail: String,
    },
    /// An answer the cloud's documentation does not describe.
    #[error("{url}: answered {status}: {detail}")]
    Unexpected {
        /// What was asked.
        url: String,
        /// The HTTP status.
        status: u16,
        /// What was wrong with it.
        detail: String,
    },
}

/// Seconds since the Unix epoch of an AWS time, `2017-09-18T08:22:00Z` (RFC 3339 in UTC, as
/// AWS writes it).
fn rfc3339_utc(s: &str) -> Option<u64> {
    let b = s.trim().as_bytes();
    let num = |r: std::ops::Range<usize>| -> Option<i64> {
        let t = std::str::from_utf8(b.get(r)?).ok()?;
        t.bytes()
            .all(|c| c.is_ascii_digit())
            .then(|| t.parse().ok())?
    };
    let sep = |i: usize, c: u8| b.get(i) == Some(&c);
    if !(sep(4, b'-') && sep(7, b'-') && (sep(10, b'T') || sep(10, b't')) && sep(13, b':'))
        || !sep(16, b':')
    {
        return None;
    }
    let (y, mo, d) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (h, mi, sec) = (num(11..13)?, num(14..16)?, num(17..19)?);
    // Fractions of a second, then Z.
    let mut i = 19;
    if sep(i, b'.') {
        i += 1;
        while b.get(i).is_some_and(u8::is_ascii_digit) {
            i += 1;
        }
    }
    if !(b.len() == i + 1 && (sep(i, b'Z') || sep(i, b'z'))) {
        return None;
    }
    if !((1..=12).contains(&mo) && (1..=31).contains(&d) && h < 24 && mi < 60 && sec < 61) {
        return None;
    }
    // Days from the civil date (Howard Hinnant's algorithm).
    let y = if mo <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (mo + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    u64::try_from(days * 86_400 + h * 3600 + mi * 60 + sec).ok()
}

/// How long from `now` until `at` (zero when it has passed).
fn until(at: SystemTime, now: SystemTime) -> Duration {
    at.duration_since(now).unwrap_or(Duration::ZERO)
}

/// AWS's `spot/instance-action`: 404 without a notice, else `{"action": …, "time": …}`.
pub(crate) fn aws_instance_action(
    status: u16,
    body: &str,
    now: SystemTime,
) -> Result<Reading, String> {
    match status {
        404 => Ok(Reading::Quiet),
        200 => {
            let v: serde_json::Value =
                serde_json::from_str(body).map_err(|e| format!("not JSON ({e}): {body:.200}"))?;
            let action = v["action"]
                .as_str()
                .ok_or_else(|| format!("no \"action\" in {body:.200}"))?;
            let time = v["time"]
                .as_str()
                .ok_or_else(|| format!("no \"time\" in {body:.200}"))?;
            let at =
                rfc3339_utc(time).ok_or_else(|| format!("\"time\" {time:?} is not a UTC time"))?;
            Ok(Reading::Notice {
                within: Some(until(SystemTime::UNIX_EPOCH + Duration::from_secs(at), now)),
                what: format!("spot instance {action} at {time}"),
            })
        }
        _ => Err(format!("not 200 or 404: {body:.200}")),
    }
}

/// AWS's rebalance recommendation: 404 without one, else `{"noticeTime": …}`. It names no
/// deadline: an interruption is likely, not scheduled.
pub(crate) fn aws_rebalance(status: u16, body: &str) -> Result<Reading, String> {
    match status {
        404 => Ok(Reading::Quiet),
        200 => {
            let v: serde_json::Value =
                serde_json::from_str(body).map_err(|e| format!("not JSON ({e}): {body:.200}"))?;
            let at = v["noticeTime"]
                .as_str()
                .ok_or_else(|| format!("no \"noticeTime\" in {body:.200}"))?;
            Ok(Reading::Notice {
                within: None,
                what: format!("rebalance recommendation of {at}"),
            })
        }
        _ => Err(format!("not 200 or 404: {body:.200}")),
    }
}

/// GCE's `instance/preempted`: `TRUE` or `FALSE`, from a server that says it is Google's.
pub(crate) fn gce_preempted(
    status: u16,
    flavor: Option<&str>,
    body: &str,
) -> Result<Reading, String> {
    if status != 200 {
        return Err(format!("not 200: {body:.200}"));
    }
    if flavor != Some("Google") {
        return Err(
            "no \"Metadata-Flavor: Google\" in the answer: not GCE's metadata server".into(),
        );
    }
    match body.trim() {
        "TRUE" => Ok(Reading::Notice {
            within: Some(GCE_NOTICE),
            what: "instance preempted".into(),
        }),
        "FALSE" => Ok(Reading::Quiet),
        other => Err(format!("neither TRUE nor FALSE: {other:.200}")),
    }
}

/// Azure's Scheduled Events: a `Preempt` event whose resources name this VM (`vm`; any event,
/// where the name could not be read), due at its `NotBefore` (an HTTP date; empty when it
/// has begun).
pub(crate) fn azure_events(
    status: u16,
    body: &str,
    vm: Option<&str>,
    now: SystemTime,
) -> Result<Reading, String> {
    if status != 200 {
        return Err(format!("not 200: {body:.200}"));
    }
    let v: serde_json::Value =
        serde_json::from_str(body).map_err(|e| format!("not JSON ({e}): {body:.200}"))?;
    let events = v["Events"]
        .as_array()
        .ok_or_else(|| format!("no \"Events\" list in {body:.200}"))?;
    for e in events {
        if e["EventType"].as_str() != Some("Preempt") {
            continue;
        }
        let ours = match vm {
            None => true,
            Some(name) => e["Resources"]
                .as_array()
                .is_some_and(|r| r.iter().any(|x| x.as_str() == Some(name))),
        };
        if !ours {
            continue;
        }
        let not_before = e["NotBefore"].as_str().unwrap_or_default();
        let within = if not_before.trim().is_empty() {
            Some(Duration::ZERO)
        } else {
            let at = httpdate::parse_http_date(not_before)
                .map_err(|_| format!("\"NotBefore\" {not_before:?} is not an HTTP date"))?;
            Some(until(at, now))
        };
        let id = e["EventId"].as_str().unwrap_or("?");
        return Ok(Reading::Notice {
            within,
            what: format!("scheduled event {id}: Preempt not before {not_before:?}"),
        });
    }
    Ok(Reading::Quiet)
}

/// A cloud's metadata server, read over HTTP.
pub(crate) struct Metadata {
    cloud: Cloud,
    base: String,
    agent: ureq::Agent,
    /// AWS's session token and when it was taken.
    token: Option<(String, Instant)>,
    /// Azure's name of this VM, once read.
    vm: Option<String>,
}

/// One answer: status, the `Metadata-Flavor` header, body.
type Answer = (u16, Option<String>, String);

impl Metadata {
    /// The metadata server of `cloud` at `base` (`http://169.254.169.254`); `host` (the
    /// worker's host, as the launcher named it) goes into the User-Agent.
    pub(crate) fn new(cloud: Cloud, base: &str, host: &str) -> Self {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .timeout_global(Some(READ_TIMEOUT))
            .http_status_as_error(false)
            .max_redirects(0)
            .user_agent(format!("hvd/{} (host {host})", env!("CARGO_PKG_VERSION")))
            .build()
            .into();
        Self {
            cloud,
            base: base.trim_end_matches('/').to_string(),
            agent,
            token: None,
            vm: None,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    fn answer(
        url: &str,
        r: Result<ureq::http::Response<ureq::Body>, ureq::Error>,
    ) -> Result<Answer, MetadataError> {
        let mut resp = r.map_err(|e| MetadataError::Unreachable {
            url: url.to_string(),
            detail: e.to_string(),
        })?;
        let status = resp.status().as_u16();
        let flavor = resp
            .headers()
            .get("Metadata-Flavor")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let body = resp
            .body_mut()
            .with_config()
            .limit(1 << 20)
            .read_to_string()
            .map_err(|e| MetadataError::Unexpected {
                url: url.to_string(),
                status,
                detail: format!("unreadable body: {e}"),
            })?;
        Ok((status, flavor, body))
    }

    fn get(&self, path: &str, headers: &[(&str, &str)]) -> Result<Answer, MetadataError> {
        let url = self.url(path);
        let mut req = self.agent.get(&url);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        Self::answer(&url, req.call())
    }

    fn unexpected(&self, path: &str, status: u16, detail: String) -> MetadataError {
        MetadataError::Unexpected {
            url: self.url(path),
            status,
            detail,
        }
    }

    /// AWS's IMDSv2 session token, taken anew when it is about to expire.
    fn aws_token(&mut self) -> Result<String, MetadataError> {
        if let Some((t, at)) = &self.token
            && at.elapsed() < AWS_TOKEN_TTL - Duration::from_secs(60)
        {
            return Ok(t.clone());
        }
        let path = "/latest/api/token";
        let url = self.url(path);
        let ttl = AWS_TOKEN_TTL.as_secs().to_string();
        let r = self
            .agent
            .put(&url)
            .header("X-aws-ec2-metadata-token-ttl-seconds", &ttl)
            .send_empty();
        let (status, _, body) = Self::answer(&url, r)?;
        if status != 200 || body.trim().is_empty() {
            return Err(self.unexpected(path, status, format!("no session token: {body:.200}")));
        }
        let token = body.trim().to_string();
        self.token = Some((token.clone(), Instant::now()));
        Ok(token)
    }

    /// `GET path` with the session token, taking a new one once if the old one is refused.
    fn aws_get(&mut self, path: &str) -> Result<Answer, MetadataError> {
        for _ in 0..2 {
            let token = self.aws_token()?;
            let a = self.get(path, &[("X-aws-ec2-metadata-token", &token)])?;
            if a.0 != 401 {
                return Ok(a);
            }
            self.token = None;
        }
        Err(self.unexpected(path, 401, "the session token was refused twice".into()))
    }

    /// Reads the notice once.
    pub(crate) fn read(&mut self, now: SystemTime) -> Result<Reading, MetadataError> {
        match self.cloud {
            Cloud::Aws => {
                let path = "/latest/meta-data/spot/instance-action";
                let (status, _, body) = self.aws_get(path)?;
                let r = aws_instance_action(status, &body, now)
                    .map_err(|d| self.unexpected(path, status, d))?;
                if r != Reading::Quiet {
                    return Ok(r);
                }
                let path = "/latest/meta-data/events/recommendations/rebalance";
                let (status, _, body) = self.aws_get(path)?;
                aws_rebalance(status, &body).map_err(|d| self.unexpected(path, status, d))
            }
            Cloud::Gce => {
                let path = "/computeMetadata/v1/instance/preempted";
                let (status, flavor, body) = self.get(path, &[("Metadata-Flavor", "Google")])?;
                gce_preempted(status, flavor.as_deref(), &body)
                    .map_err(|d| self.unexpected(path, status, d))
            }
            Cloud::Azure => {
                let headers = [("Metadata", "true")];
                if self.vm.is_none() {
                    let path = "/metadata/instance/compute/name?api-version=2021-02-01&format=text";
                    let (status, _, body) = self.get(path, &headers)?;
                    if status == 200 && !body.trim().is_empty() {
                        self.vm = Some(body.trim().to_string());
                    } else {
                        return Err(self.unexpected(
                            path,
                            status,
                            format!("no VM name: {body:.200}"),
                        ));
                    }
                }
                let path = "/metadata/scheduledevents?api-version=2020-07-01";
                let (status, _, body) = self.get(path, &headers)?;
                azure_events(status, &body, self.vm.as_deref(), now)
                    .map_err(|d| self.unexpected(path, status, d))
            }
        }
    }
}

/// Polls `cloud`'s metadata at `base` every `every` on a thread of its own until a notice
/// comes, then sends it for worker `worker` with `send`. Errors are logged once until the
/// server answers again.
pub(crate) fn watch(
    cloud: Cloud,
    base: &str,
    every: Duration,
    (worker, host): (u64, &str),
    send: impl Fn(&WorkerMsg) -> bool + Send + 'static,
) {
    let mut m = Metadata::new(cloud, base, host);
    let base = base.to_string();
    let spawned = thread::Builder::new()
        .name("hvd-preemption".into())
        .spawn(move || {
            tracing::debug!(%cloud, %base, "watching for preemption notices");
            let mut failing = false;
            loop {
                match m.read(SystemTime::now()) {
                    Ok(Reading::Quiet) => {
                        if failing {
                            tracing::info!(%cloud, "the metadata server answers again");
                            failing = false;
                        }
                    }
                    Ok(Reading::Notice { within, what }) => {
                        let msg = WorkerMsg::Notice {
                            worker,
                            source: cloud.source(),
                            within_ms: within.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
                        };
                        let told = send(&msg);
                        tracing::warn!(
                            %cloud,
                            %what,
                            deadline_s = within.map(|d| d.as_secs_f64()),
                            told,
                            "preemption notice: leaving the job gracefully"
                        );
                        return;
                    }
                    Err(e) => {
                        if !failing {
                            tracing::warn!(%cloud, error = %e, "cannot read the cloud's preemption notice; reading again (an unreadable server is never taken for a notice)");
                            failing = true;
                        }
                    }
                }
                thread::sleep(every);
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "could not start the preemption watcher");
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use std::collections::HashMap;
    use std::io::{BufRead, BufReader, Write};
    use std::net::TcpListener;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};

    use super::*;

    /// One request as the fake server saw it.
    #[derive(Debug, Clone)]
    struct Request {
        method: String,
        path: String,
        headers: HashMap<String, String>,
    }

    /// An answer: status, headers, body.
    type Reply = (u16, Vec<(&'static str, String)>, String);

    /// A metadata server on loopback that answers with `handler`; returns its base URL.
    fn fake(handler: impl Fn(&Request) -> Reply + Send + Sync + 'static) -> String {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let base = format!("http://{}", l.local_addr().unwrap());
        let handler = Arc::new(handler);
        thread::spawn(move || {
            for s in l.incoming().flatten() {
                let handler = Arc::clone(&handler);
                thread::spawn(move || {
                    let mut r = BufReader::new(s.try_clone().unwrap());
                    let mut line = String::new();
                    if r.read_line(&mut line).unwrap_or(0) == 0 {
                        return;
                    }
                    let mut parts = line.split_whitespace();
                    let method = parts.next().unwrap_or_default().to_string();
                    let path = parts.next().unwrap_or_default().to_string();
                    let mut headers = HashMap::new();
                    loop {
                        let mut h = String::new();
                        if r.read_line(&mut h).unwrap_or(0) == 0 || h.trim().is_empty() {
                            break;
                        }
                        if let Some((k, v)) = h.split_once(':') {
                            headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
                        }
                    }
                    let (status, extra, body) = handler(&Request {
                        method,
                        path,
                        headers,
                    });
                    let mut s = s;
                    let mut head = format!(
                        "HTTP/1.1 {status} X\r\nContent-Length: {}\r\nConnection: close\r\n",
                        body.len()
                    );
                    for (k, v) in extra {
                        head.push_str(&format!("{k}: {v}\r\n"));
                    }
                    let _ = write!(s, "{head}\r\n{body}");
                });
            }
        });
        base
    }

    fn not_found() -> Reply {
        (404, vec![], "Not Found".into())
    }

    #[test]
    fn aws_times_are_read_as_utc() {
        assert_eq!(rfc3339_utc("2017-09-18T08:22:00Z"), Some(1_505_722_920));
        assert_eq!(rfc3339_utc("2000-02-29T23:59:59.250Z"), Some(951_868_799));
        for bad in [
            "2017-09-18 08:22:00Z",
            "2017-09-18T08:22:00",
            "2017-13-18T08:22:00Z",
            "",
            "x",
        ] {
            assert_eq!(rfc3339_utc(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn answers_are_read_as_each_cloud_documents_them() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_505_722_800);
        assert_eq!(aws_instance_action(404, "", now), Ok(Reading::Quiet));
        let r = aws_instance_action(
            200,
            r#"{"action": "terminate", "time": "2017-09-18T08:22:00Z"}"#,
            now,
        );
        assert_eq!(
            r,
            Ok(Reading::Notice {
                within: Some(Duration::from_secs(120)),
                what: "spot instance terminate at 2017-09-18T08:22:00Z".into()
            })
        );
        assert!(aws_instance_action(200, "{}", now).is_err());
        assert!(aws_instance_action(500, "", now).is_err());
        assert_eq!(aws_rebalance(404, ""), Ok(Reading::Quiet));
        assert!(matches!(
            aws_rebalance(200, r#"{"noticeTime": "2020-11-05T08:22:00Z"}"#),
            Ok(Reading::Notice { within: None, .. })
        ));
        assert_eq!(
            gce_preempted(200, Some("Google"), "FALSE"),
            Ok(Reading::Quiet)
        );
        assert!(matches!(
            gce_preempted(200, Some("Google"), "TRUE"),
            Ok(Reading::Notice { within: Some(d), .. }) if d == GCE_NOTICE
        ));
        assert!(
            gce_preempted(200, None, "TRUE").is_err(),
            "not Google's server"
        );
        assert!(gce_preempted(200, Some("Google"), "maybe").is_err());
        let quiet = r#"{"DocumentIncarnation": 2, "Events": []}"#;
        assert_eq!(
            azure_events(200, quiet, Some("vm-1"), now),
            Ok(Reading::Quiet)
        );
        let preempt = r#"{"DocumentIncarnation": 3, "Events": [{"EventId": "A1",
            "EventStatus": "Scheduled", "EventType": "Preempt", "ResourceType": "VirtualMachine",
            "Resources": ["vm-1"], "NotBefore": "Mon, 18 Sep 2017 08:22:30 GMT",
            "Description": "", "EventSource": "Platform", "DurationInSeconds": -1}]}"#;
        assert!(matches!(
            azure_events(200, preempt, Some("vm-1"), now),
            Ok(Reading::Notice { within: Some(d), .. }) if d == Duration::from_secs(150)
        ));
        assert_eq!(
            azure_events(200, preempt, Some("vm-2"), now),
            Ok(Reading::Quiet),
            "another VM's"
        );
        let reboot = preempt.replace("Preempt", "Reboot");
        assert_eq!(
            azure_events(200, &reboot, Some("vm-1"), now),
            Ok(Reading::Quiet)
        );
        assert!(azure_events(200, "[]", None, now).is_err());
    }

    #[test]
    fn aws_is_read_with_an_imdsv2_token_renewed_when_refused() {
        let token = Arc::new(Mutex::new(1u32));
        let action = Arc::new(Mutex::new(None::<String>));
        let (t, a) = (Arc::clone(&token), Arc::clone(&action));
        let base = fake(move |r| {
            let current = format!("tok-{}", t.lock().unwrap());
            match (r.method.as_str(), r.path.as_str()) {
                ("PUT", "/latest/api/token") => {
                    if r.headers
                        .contains_key("x-aws-ec2-metadata-token-ttl-seconds")
                    {
                        (200, vec![], current)
                    } else {
                        (400, vec![], "Missing TTL".into())
                    }
                }
                ("GET", _) if r.headers.get("x-aws-ec2-metadata-token") != Some(&current) => {
                    (401, vec![], "Unauthorized".into())
                }
                ("GET", "/latest/meta-data/spot/instance-action") => match &*a.lock().unwrap() {
                    Some(body) => (200, vec![], body.clone()),
                    None => not_found(),
                },
                ("GET", "/latest/meta-data/events/recommendations/rebalance") => not_found(),
                _ => (400, vec![], "Bad Request".into()),
            }
        });
        let mut m = Metadata::new(Cloud::Aws, &base, "h");
        assert_eq!(m.read(SystemTime::now()), Ok(Reading::Quiet));
        *token.lock().unwrap() = 2; // the old token expires
        assert_eq!(
            m.read(SystemTime::now()),
            Ok(Reading::Quiet),
            "a new token is taken"
        );
        *action.lock().unwrap() =
            Some(r#"{"action": "stop", "time": "2017-09-18T08:22:00Z"}"#.into());
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_505_722_800);
        assert!(matches!(
            m.read(now),
            Ok(Reading::Notice { within: Some(d), .. }) if d == Duration::from_secs(120)
        ));
    }

    #[test]
    fn gce_is_read_with_its_flavor_header_and_only_from_google() {
        let preempted = Arc::new(Mutex::new("FALSE"));
        let p = Arc::clone(&preempted);
        let base = fake(move |r| {
            if r.headers.get("metadata-flavor").map(String::as_str) != Some("Google") {
                return (403, vec![], "Missing Metadata-Flavor:Google header.".into());
            }
            match r.path.as_str() {
                "/computeMetadata/v1/instance/preempted" => (
                    200,
                    vec![("Metadata-Flavor", "Google".into())],
                    (*p.lock().unwrap()).into(),
                ),
                _ => not_found(),
            }
        });
        let mut m = Metadata::new(Cloud::Gce, &base, "h");
        assert_eq!(m.read(SystemTime::now()), Ok(Reading::Quiet));
        *preempted.lock().unwrap() = "TRUE";
        assert!(matches!(
            m.read(SystemTime::now()),
            Ok(Reading::Notice { .. })
        ));
        // A server that does not say it is Google's is not believed.
        let impostor = fake(|_| (200, vec![], "TRUE".into()));
        let e = Metadata::new(Cloud::Gce, &impostor, "h").read(SystemTime::now());
        assert!(matches!(e, Err(MetadataError::Unexpected { .. })), "{e:?}");
    }

    #[test]
    fn azure_is_read_for_this_vm_with_its_metadata_header() {
        let events = Arc::new(Mutex::new(
            r#"{"DocumentIncarnation": 0, "Events": []}"#.to_string(),
        ));
        let ev = Arc::clone(&events);
        let base = fake(move |r| {
            if r.headers.get("metadata").map(String::as_str) != Some("true") {
                return (
                    400,
                    vec![],
                    r#"{"error": "Bad request. Required metadata header not specified"}"#.into(),
                );
            }
            match r.path.as_str() {
                "/metadata/instance/compute/name?api-version=2021-02-01&format=text" => {
                    (200, vec![], "vm-1".into())
                }
                "/metadata/scheduledevents?api-version=2020-07-01" => {
                    (200, vec![], ev.lock().unwrap().clone())
                }
                _ => not_found(),
            }
        });
        let mut m = Metadata::new(Cloud::Azure, &base, "h");
        assert_eq!(m.read(SystemTime::now()), Ok(Reading::Quiet));
        *events.lock().unwrap() = r#"{"DocumentIncarnation": 1, "Events": [{"EventId": "B2",
            "EventType": "Preempt", "ResourceType": "VirtualMachine", "Resources": ["vm-1"],
            "EventStatus": "Scheduled", "NotBefore": ""}]}"#
            .into();
        assert!(matches!(
            m.read(SystemTime::now()),
            Ok(Reading::Notice {
                within: Some(Duration::ZERO),
                ..
            })
        ));
    }

    #[test]
    fn a_server_that_is_down_is_never_a_notice_and_one_that_comes_back_is_read() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        drop(l);
        let base = format!("http://{addr}");
        let e = Metadata::new(Cloud::Gce, &base, "h").read(SystemTime::now());
        assert!(matches!(e, Err(MetadataError::Unreachable { .. })), "{e:?}");
        // The watcher keeps polling a dead server without reporting anything.
        let sent = Arc::new(AtomicUsize::new(0));
        let s = Arc::clone(&sent);
        watch(
            Cloud::Gce,
            &base,
            Duration::from_millis(20),
            (7, "h"),
            move |msg| {
                assert!(
                    matches!(msg, WorkerMsg::Notice { worker: 7, .. }),
                    "{msg:?}"
                );
                s.fetch_add(1, Ordering::SeqCst);
                true
            },
        );
        thread::sleep(Duration::from_millis(300));
        assert_eq!(sent.load(Ordering::SeqCst), 0, "a dead server is no notice");
        // The server comes up, preempted: one notice, sent once.
        let up = fake(|_| {
            (
                200,
                vec![("Metadata-Flavor", "Google".into())],
                "TRUE".into(),
            )
        });
        let sent2 = Arc::new(AtomicUsize::new(0));
        let s2 = Arc::clone(&sent2);
        watch(
            Cloud::Gce,
            &up,
            Duration::from_millis(20),
            (8, "h"),
            move |_| {
                s2.fetch_add(1, Ordering::SeqCst);
                true
            },
        );
        thread::sleep(Duration::from_millis(300));
        assert_eq!(sent2.load(Ordering::SeqCst), 1, "one notice, once");
    }
}
