//! The summary of a replay run: what was sent, what came back, how fast, and what ctxproxy
//! saved (from its response headers). Printed, written as JSON, and compared run to run.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::analyze::Percentiles;

/// What one request gave.
#[derive(Debug, Clone, Default)]
pub struct Sample {
    /// HTTP status; 0 when no response came (connect error, timeout).
    pub status: u16,
    pub latency_ms: f64,
    /// Streams: time to the first body byte.
    pub ttfb_ms: Option<f64>,
    pub tokens_before: Option<u64>,
    pub tokens_after: Option<u64>,
    /// `X-Ctxproxy-Cache`.
    pub cache: Option<String>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct CacheCounts {
    pub hit: u64,
    pub dedup: u64,
    pub miss: u64,
    pub bypass: u64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Report {
    pub label: String,
    pub requests: u64,
    /// Responses that were not 2xx, and requests with no response.
    pub errors: u64,
    /// By HTTP status; `"none"` for no response.
    pub errors_by_status: BTreeMap<String, u64>,
    pub duration_s: f64,
    pub throughput_rps: f64,
    /// From the intended send time (open loop) or the send (closed loop) to the last byte.
    pub latency_ms: Percentiles,
    /// The same, over the answers no cache gave (`X-Ctxproxy-Cache` not `hit` nor `dedup`):
    /// what the proxy adds to a model call.
    #[serde(default)]
    pub uncached_latency_ms: Percentiles,
    /// Streams only.
    pub ttfb_ms: Option<Percentiles>,
    pub streams: u64,
    /// Prompt tokens as sent by the client and as sent upstream (`X-Ctxproxy-Tokens-*`).
    pub tokens_before: u64,
    pub tokens_after: u64,
    pub cache: CacheCounts,
}

impl Report {
    pub fn of(label: &str, samples: &[Sample], duration_s: f64) -> Report {
        let mut report = Report {
            label: label.to_owned(),
            requests: samples.len() as u64,
            duration_s,
            throughput_rps: if duration_s > 0.0 {
                samples.len() as f64 / duration_s
            } else {
                0.0
            },
            latency_ms: Percentiles::of(samples.iter().map(|s| s.latency_ms).collect()),
            uncached_latency_ms: Percentiles::of(
                samples
                    .iter()
                    .filter(|s| !matches!(s.cache.as_deref(), Some("hit" | "dedup")))
                    .map(|s| s.latency_ms)
                    .collect(),
            ),
            ..Report::default()
        };
        let ttfb: Vec<f64> = samples.iter().filter_map(|s| s.ttfb_ms).collect();
        report.streams = ttfb.len() as u64;
        report.ttfb_ms = (!ttfb.is_empty()).then(|| Percentiles::of(ttfb));
        for sample in samples {
            if !(200..300).contains(&sample.status) {
                report.errors += 1;
                let status = match sample.status {
                    0 => "none".to_owned(),
                    s => s.to_string(),
                };
                *report.errors_by_status.entry(status).or_default() += 1;
            }
            report.tokens_before += sample.tokens_before.unwrap_or(0);
            report.tokens_after += sample.tokens_after.unwrap_or(0);
            let cache = &mut report.cache;
            match sample.cache.as_deref() {
                Some("hit") => cache.hit += 1,
                Some("dedup") => cache.dedup += 1,
                Some("miss") => cache.miss += 1,
                Some("bypass") => cache.bypass += 1,
                _ => {}
            }
        }
        report
    }

    fn rows(&self) -> Vec<(&'static str, String)> {
        let p =
            |x: &Percentiles| format!("{:.2} / {:.2} / {:.2} / {:.2}", x.p50, x.p90, x.p99, x.max);
        let saved = if self.tokens_before > 0 {
            100.0 * (1.0 - self.tokens_after as f64 / self.tokens_before as f64)
        } else {
            0.0
        };
        let answered = self.requests.max(1) as f64;
        vec![
            ("requests", self.requests.to_string()),
            (
                "errors",
                format!("{} {:?}", self.errors, self.errors_by_status),
            ),
            ("duration (s)", format!("{:.2}", self.duration_s)),
            ("throughput (req/s)", format!("{:.1}", self.throughput_rps)),
            ("latency ms p50/p90/p99/max", p(&self.latency_ms)),
            ("  without cache answers", p(&self.uncached_latency_ms)),
            (
                "stream TTFB ms p50/p90/p99/max",
                self.ttfb_ms.as_ref().map_or_else(|| "-".to_owned(), p),
            ),
            (
                "prompt tokens before → after",
                format!(
                    "{} → {} ({saved:.1}% saved)",
                    self.tokens_before, self.tokens_after
                ),
            ),
            (
                "cache hit / dedup / miss / bypass",
                format!(
                    "{} / {} / {} / {} (hit {:.1}%, dedup {:.1}%)",
                    self.cache.hit,
                    self.cache.dedup,
                    self.cache.miss,
                    self.cache.bypass,
                    100.0 * self.cache.hit as f64 / answered,
                    100.0 * self.cache.dedup as f64 / answered
                ),
            ),
        ]
    }

    pub fn render(&self) -> String {
        self.rows()
            .into_iter()
            .map(|(name, value)| format!("{name:<34} {value}\n"))
            .collect()
    }
}

/// Two reports side by side.
pub fn diff(a: &Report, b: &Report) -> String {
    let mut out = format!("{:<34} {:<44} {}\n", "", a.label, b.label);
    for ((name, left), (_, right)) in a.rows().into_iter().zip(b.rows()) {
        out.push_str(&format!("{name:<34} {left:<44} {right}\n"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_add_up() {
        let ok = |ms: f64, cache: &str| Sample {
            status: 200,
            latency_ms: ms,
            tokens_before: Some(100),
            tokens_after: Some(40),
            cache: Some(cache.to_owned()),
            ..Sample::default()
        };
        let samples = vec![
            ok(10.0, "miss"),
            ok(1.0, "hit"),
            Sample {
                status: 503,
                latency_ms: 5.0,
                ..Sample::default()
            },
            Sample::default(),
        ];
        let report = Report::of("run", &samples, 2.0);
        assert_eq!((report.requests, report.errors), (4, 2));
        assert_eq!(report.errors_by_status["503"], 1);
        assert_eq!(report.errors_by_status["none"], 1);
        assert_eq!((report.tokens_before, report.tokens_after), (200, 80));
        assert_eq!(
            report.cache,
            CacheCounts {
                hit: 1,
                dedup: 0,
                miss: 1,
                bypass: 0
            }
        );
        assert_eq!(report.throughput_rps, 2.0);
        assert_eq!(report.latency_ms.max, 10.0);
        assert_eq!(report.uncached_latency_ms.p50, 5.0);
        assert!(diff(&report, &report).contains("run"));
    }
}
