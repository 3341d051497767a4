//! The requests to replay: ctxproxy recordings (`{"request": …}` per line, with `unix_ms` for
//! recorded timing) or plain JSONL request bodies, as in `../shared/data`.

use std::io::BufRead;
use std::path::Path;

use serde_json::Value;

/// One request body and, when the file says, when it was sent (ms since the epoch).
#[derive(Debug, Clone)]
pub struct Recorded {
    pub body: Value,
    pub unix_ms: Option<f64>,
}

/// Every request of `paths`, in order (recordings, whose lines all carry `unix_ms`, in time
/// order, whatever the order of the files: `traffic.jsonl*` lists the newest file first); lines
/// that hold no JSON object are skipped and counted. An error names the file.
pub fn load(paths: &[impl AsRef<Path>]) -> std::io::Result<(Vec<Recorded>, u64)> {
    let mut requests = Vec::new();
    let mut skipped = 0;
    for path in paths {
        let path = path.as_ref();
        let named =
            |e: std::io::Error| std::io::Error::new(e.kind(), format!("{}: {e}", path.display()));
        let file = std::io::BufReader::new(std::fs::File::open(path).map_err(named)?);
        for line in file.lines() {
            let line = line.map_err(named)?;
            if line.trim().is_empty() {
                continue;
            }
            match parse_line(&line) {
                Some(recorded) => requests.push(recorded),
                None => skipped += 1,
            }
        }
    }
    if requests.iter().all(|r| r.unix_ms.is_some()) {
        requests.sort_by(|a, b| {
            a.unix_ms
                .unwrap_or(0.0)
                .total_cmp(&b.unix_ms.unwrap_or(0.0))
        });
    }
    Ok((requests, skipped))
}

fn parse_line(line: &str) -> Option<Recorded> {
    let value: Value = serde_json::from_str(line).ok()?;
    let unix_ms = value.get("unix_ms").and_then(Value::as_f64);
    let body = match value.get("request") {
        Some(inner) if inner.is_object() => inner.clone(),
        _ => value,
    };
    (body.is_object() && body.get("messages").is_some()).then_some(Recorded { body, unix_ms })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recordings_and_plain_bodies_are_read() {
        let plain = parse_line(r#"{"model":"m","messages":[]}"#).unwrap();
        assert_eq!(plain.body["model"], "m");
        assert_eq!(plain.unix_ms, None);
        let recorded =
            parse_line(r#"{"unix_ms":1700000000123,"request":{"model":"r","messages":[]}}"#)
                .unwrap();
        assert_eq!(recorded.body["model"], "r");
        assert_eq!(recorded.unix_ms, Some(1_700_000_000_123.0));
        assert!(parse_line("not json").is_none());
        assert!(parse_line(r#"{"a":"b"}"#).is_none());
    }

    #[test]
    fn rotated_recordings_are_read_in_time_order_and_errors_name_the_file() {
        let dir = std::env::temp_dir().join(format!("ctxproxy-source-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let line = |ms: u64| {
            format!("{{\"unix_ms\":{ms},\"request\":{{\"model\":\"m{ms}\",\"messages\":[]}}}}\n")
        };
        let (newest, oldest) = (dir.join("rec.jsonl"), dir.join("rec.jsonl.1"));
        std::fs::write(&newest, line(30) + &line(40)).unwrap();
        std::fs::write(&oldest, line(10) + &line(20)).unwrap();
        let (requests, _) = load(&[&newest, &oldest]).unwrap();
        let times: Vec<f64> = requests.iter().filter_map(|r| r.unix_ms).collect();
        assert_eq!(times, [10.0, 20.0, 30.0, 40.0]);
        let missing = load(&[dir.join("nope.jsonl")]).unwrap_err();
        assert!(missing.to_string().contains("nope.jsonl"), "{missing}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
