//! Load from `wrk` (Debian's package), an HTTP load generator that is not ours: a Lua
//! script names the requests, and its `--latency` report is read back.

use std::process::Command;
use std::time::Duration;

/// What wrk reported of one load.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WrkReport {
    /// Answers with a 2xx status.
    pub decisions: u64,
    /// Answers with a status of 400 or over (wrk counts those only), and requests
    /// that failed on the socket or got no answer within the timeout.
    pub errors: u64,
    /// 2xx answers per second.
    pub per_second: f64,
    pub p50: Duration,
    pub p99: Duration,
}

/// A decision request for `agent` with its `token`, as a `wrk.format` call: the same
/// action each time, of an allowed tool (`work`) with an empty input.
pub fn decide_request(agent: &str, token: &str) -> String {
    format!(
        "wrk.format(\"POST\", \"/v1/agents/{agent}/actions\", {{[\"Authorization\"] = \"Bearer {token}\", [\"Content-Type\"] = \"application/json\"}}, '{{\"tool\":\"work\",\"input\":{{}}}}')"
    )
}

/// A script that sends `requests` (`wrk.format` calls, built once) in turn.
pub fn round_robin(requests: &[String]) -> String {
    format!(
        "local requests = {{}}\nlocal n = 0\ninit = function(args)\n  requests = {{ {} }}\nend\nrequest = function()\n  n = n + 1\n  return requests[n % #requests + 1]\nend\n",
        requests.join(", ")
    )
}

/// Runs wrk with `script` against `url`: `connections` connections over two threads
/// (one for a single connection), for `seconds`.
pub fn run(url: &str, script: &str, connections: usize, seconds: u64) -> Result<WrkReport, String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let path = dir.path().join("load.lua");
    std::fs::write(&path, script).map_err(|e| e.to_string())?;
    let output = Command::new("wrk")
        .args(["-t", &connections.clamp(1, 2).to_string()])
        .args(["-c", &connections.to_string()])
        // A request unanswered for this long is counted as an error, not left out of
        // the latency figures (wrk's default is 2 s).
        .args(["--timeout", "30s"])
        .args(["-d", &format!("{seconds}s"), "--latency", "-s"])
        .arg(&path)
        .arg(url)
        .output()
        .map_err(|e| format!("wrk: {e} (apt-get install wrk)"))?;
    let report = String::from_utf8_lossy(&output.stdout).to_string();
    if !output.status.success() {
        return Err(format!(
            "wrk failed: {report}{}",
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    parse(&report).ok_or_else(|| format!("wrk's report was not understood:\n{report}"))
}

/// wrk's `--latency` report: "N requests in …", "Non-2xx or 3xx responses: E",
/// "Socket errors: connect C, read R, write W, timeout T", "Requests/sec: R", and the
/// "50%"/"99%" lines of its latency distribution.
pub fn parse(report: &str) -> Option<WrkReport> {
    let duration = |text: &str| -> Option<Duration> {
        let (number, unit) = text.split_at(text.find(|c: char| c.is_ascii_alphabetic())?);
        let number: f64 = number.parse().ok()?;
        let seconds = match unit {
            "us" => number / 1e6,
            "ms" => number / 1e3,
            "s" => number,
            "m" => number * 60.0,
            _ => return None,
        };
        Some(Duration::from_secs_f64(seconds))
    };
    let mut requests = None;
    let mut errors = 0;
    let mut socket_errors = 0;
    let mut per_second = None;
    let (mut p50, mut p99) = (None, None);
    for line in report.lines().map(str::trim) {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            [n, "requests", "in", ..] => requests = n.parse::<u64>().ok(),
            ["Non-2xx", "or", "3xx", "responses:", n] => errors = n.parse().ok()?,
            ["Socket", "errors:", counts @ ..] => {
                // "connect 0, read 1, write 0, timeout 2": every other word a count.
                for count in counts.iter().skip(1).step_by(2) {
                    socket_errors += count.trim_end_matches(',').parse::<u64>().ok()?;
                }
            }
            ["Requests/sec:", r] => per_second = r.parse::<f64>().ok(),
            ["50%", d] => p50 = duration(d),
            ["99%", d] => p99 = duration(d),
            _ => {}
        }
    }
    let requests = requests?;
    let decisions = requests.saturating_sub(errors);
    Some(WrkReport {
        decisions,
        errors: errors + socket_errors,
        per_second: per_second? * decisions as f64 / requests.max(1) as f64,
        p50: p50?,
        p99: p99?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_is_read_with_its_errors_taken_out() {
        let report = "Running 2s test @ http://127.0.0.1:9200
  2 threads and 16 connections
  Latency Distribution
     50%    1.50ms
     75%    2.00ms
     90%    3.00ms
     99%   12.25ms
  2000 requests in 2.00s, 1.00MB read
  Socket errors: connect 0, read 1, write 0, timeout 2
  Non-2xx or 3xx responses: 500
Requests/sec:   1000.00
Transfer/sec:    500.00KB
";
        let read = parse(report).unwrap();
        assert_eq!((read.decisions, read.errors), (1500, 503));
        assert!((read.per_second - 750.0).abs() < 1e-9);
        assert_eq!(read.p50, Duration::from_micros(1500));
        assert_eq!(read.p99, Duration::from_micros(12250));
        assert_eq!(parse("no report here"), None);
    }
}
