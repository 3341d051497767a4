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

/// Every request of `paths`, in order; lines that hold no JSON object are skipped and counted.
pub fn load(paths: &[impl AsRef<Path>]) -> std::io::Result<(Vec<Recorded>, u64)> {
    let mut requests = Vec::new();
    let mut skipped = 0;
    for path in paths {
        let file = std::io::BufReader::new(std::fs::File::open(path)?);
        for line in file.lines() {
            let line = line?;
            if line.trim().is_empty() {
                continue;
            }
            match parse_line(&line) {
                Some(recorded) => requests.push(recorded),
                None => skipped += 1,
            }
        }
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
}
