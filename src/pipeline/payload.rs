//! What a tool result holds under its wrappers, so that its identifiers are found whatever the
//! tool printed: MCP envelopes (a text part `{"type":"text","text":…}`, a `CallToolResult`
//! `{"content":[…],"structuredContent":…}` whose parts are all text, with the JSON or literal
//! their text holds) are opened,
//! and Python literals, which database tools print (`[{'id': 7, 'at': datetime.date(2024, 5,
//! 1), 'avg': Decimal('29.1')}]`), are read as JSON. Pure functions.

use std::borrow::Cow;

use serde_json::{Map, Number, Value};

use super::identifiers::parse_json;

/// Envelopes opened at most (a text part holding a result holding a text part is three).
const MAX_ENVELOPES: usize = 6;
/// Nesting read at most in a Python literal (deeper input is not read as one).
const MAX_DEPTH: usize = 64;

/// A tool result's content: a tree (JSON, or a Python literal read as JSON), or text.
#[derive(Debug, PartialEq)]
pub enum Payload<'a> {
    Tree(Value),
    Text(Cow<'a, str>),
}

impl Payload<'_> {
    /// The tree, when the content is one.
    pub fn into_tree(self) -> Option<Value> {
        match self {
            Payload::Tree(value) => Some(value),
            Payload::Text(_) => None,
        }
    }
}

/// The content of a tool result under its envelopes.
pub fn read(text: &str) -> Payload<'_> {
    let mut current: Cow<'_, str> = Cow::Borrowed(text);
    for _ in 0..MAX_ENVELOPES {
        let Some(value) = parse_json(&current).or_else(|| python_literal(&current)) else {
            return Payload::Text(current);
        };
        match opened(&value) {
            Some(inner) => current = Cow::Owned(inner),
            None => return Payload::Tree(value),
        }
    }
    Payload::Text(current)
}

/// The tree of a tool result under its envelopes, when it is one.
pub fn tree(text: &str) -> Option<Value> {
    read(text).into_tree()
}

/// The text an envelope wraps: a text part's `text`, or a tool result's text parts joined.
/// `None` when the value is not an envelope.
fn opened(value: &Value) -> Option<String> {
    match value {
        Value::Object(map) if is_text_part(map) => map.get("text")?.as_str().map(str::to_owned),
        Value::Object(map) if is_tool_result(map) => {
            let parts = map.get("content")?.as_array()?;
            if parts.is_empty() {
                // Only structured content: that is the result.
                return map
                    .get("structuredContent")
                    .filter(|s| !s.is_null())
                    .map(Value::to_string);
            }
            // Every part text: other parts (resources, images) stay, in their envelope.
            texts_of(parts)
        }
        Value::Array(items) if !items.is_empty() => texts_of(items),
        _ => None,
    }
}

/// The texts of `parts` joined, when every part is a text part.
fn texts_of(parts: &[Value]) -> Option<String> {
    let texts: Option<Vec<&str>> = parts
        .iter()
        .map(|p| {
            p.as_object()
                .filter(|p| is_text_part(p))?
                .get("text")?
                .as_str()
        })
        .collect();
    texts.map(|t| t.join("\n"))
}

/// `{"type": "text", "text": "…"}`, with nothing but annotations and metadata beside.
fn is_text_part(map: &Map<String, Value>) -> bool {
    map.get("type").and_then(Value::as_str) == Some("text")
        && map.get("text").is_some_and(Value::is_string)
        && map.keys().all(|k| {
            matches!(
                k.as_str(),
                "type" | "text" | "annotations" | "meta" | "_meta"
            )
        })
}

/// An MCP `CallToolResult` that is no error (an error keeps its envelope, `isError` said):
/// `content` parts, and nothing but its own fields beside.
fn is_tool_result(map: &Map<String, Value>) -> bool {
    map.get("content").is_some_and(Value::is_array)
        && map.get("isError").and_then(Value::as_bool) != Some(true)
        && map.keys().all(|k| {
            matches!(
                k.as_str(),
                "content" | "structuredContent" | "isError" | "meta" | "_meta"
            )
        })
}

/// What the MCP envelopes around `text` wrap, when they say nothing else: their annotations and
/// metadata are null, the result is no error, every part is text, and the structured content,
/// if any, repeats the parts (FastMCP's `{"result": [parts]}`) or is the JSON their one text
/// holds. `None` when `text` is no such envelope. Unlike `read`, nothing is left out but what
/// is null or said twice: the working set keeps a result this way.
pub fn bare(text: &str) -> Option<String> {
    let mut current: Option<String> = None;
    for _ in 0..MAX_ENVELOPES {
        let candidate = current.as_deref().unwrap_or(text);
        if !may_be_envelope(candidate) {
            break;
        }
        let Some(value) = parse_json(candidate) else {
            break;
        };
        match bare_opened(&value) {
            Some(inner) => current = Some(inner),
            None => break,
        }
    }
    current
}

/// Whether `text` may be an envelope `bare_opened` opens, read without parsing it: an object
/// with a `text` or a `content` key. A key is in the text as it is, quoted, unless written with
/// a `\u` escape (no other escape makes one of these letters), so most results, which are
/// none, are not parsed for nothing.
fn may_be_envelope(text: &str) -> bool {
    let bytes = text.as_bytes();
    text.trim_start().starts_with('{')
        && [&b"\"text\""[..], b"\"content\"", b"\\u"]
            .iter()
            .any(|needle| memchr::memmem::find(bytes, needle).is_some())
}

/// `opened`, for an envelope that says nothing but what it wraps.
fn bare_opened(value: &Value) -> Option<String> {
    let map = value.as_object()?;
    if is_bare_text_part(map) {
        return map.get("text")?.as_str().map(str::to_owned);
    }
    let silent = |key: &str| map.get(key).is_none_or(Value::is_null);
    let parts = map.get("content")?.as_array()?;
    let texts: Vec<&str> = parts
        .iter()
        .map(|p| {
            p.as_object()
                .filter(|p| is_bare_text_part(p))?
                .get("text")?
                .as_str()
        })
        .collect::<Option<_>>()?;
    let no_error = map.get("isError").is_none_or(|e| e == &Value::Bool(false));
    let structured = map
        .get("structuredContent")
        .is_none_or(|s| s.is_null() || repeats(s, &texts));
    // Parts joined by a line break are told apart only if none holds one; nothing at all would
    // be an empty tool message, which some upstreams refuse.
    let parts_told_apart = texts.len() == 1 || texts.iter().all(|t| !t.contains('\n'));
    let said = texts.iter().any(|t| !t.trim().is_empty());
    (is_tool_result(map)
        && no_error
        && silent("meta")
        && silent("_meta")
        && structured
        && parts_told_apart
        && said)
        .then(|| texts.join("\n"))
}

/// `{"type": "text", "text": "…"}`, with only null annotations and metadata beside.
fn is_bare_text_part(map: &Map<String, Value>) -> bool {
    is_text_part(map)
        && ["annotations", "meta", "_meta"]
            .iter()
            .all(|k| map.get(*k).is_none_or(Value::is_null))
}

/// Whether structured content says what the text parts `texts` say: the same parts (under
/// `result`, as FastMCP wraps them), or the JSON of the one text.
fn repeats(structured: &Value, texts: &[&str]) -> bool {
    let inner = match structured.as_object() {
        Some(map) if map.len() == 1 => map.get("result").unwrap_or(structured),
        _ => structured,
    };
    let same_parts = inner.as_array().is_some_and(|parts| {
        parts.len() == texts.len()
            && parts.iter().zip(texts).all(|(part, text)| {
                part.as_object()
                    .filter(|p| is_bare_text_part(p))
                    .and_then(|p| p.get("text"))
                    .and_then(Value::as_str)
                    == Some(*text)
            })
    });
    same_parts
        || matches!(texts, [text] if parse_json(text).is_some_and(|v| &v == inner || &v == structured))
}

/// A Python literal (`repr` of dicts, lists, tuples, strings, numbers, `None`/`True`/`False`,
/// `Decimal('1.5')`, `datetime.date(2024, 5, 1)`) as JSON, when the whole text is one
/// container.
pub fn python_literal(text: &str) -> Option<Value> {
    let trimmed = text.trim();
    if !trimmed.starts_with(['[', '{', '(']) {
        return None;
    }
    let mut reader = Reader {
        text: trimmed.as_bytes(),
        at: 0,
    };
    let value = reader.value(0)?;
    reader.skip_space();
    (reader.at == reader.text.len() && (value.is_array() || value.is_object())).then_some(value)
}

struct Reader<'a> {
    text: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn peek(&self) -> Option<u8> {
        self.text.get(self.at).copied()
    }

    fn skip_space(&mut self) {
        while self.peek().is_some_and(|b| b.is_ascii_whitespace()) {
            self.at += 1;
        }
    }

    fn eat(&mut self, byte: u8) -> bool {
        self.skip_space();
        if self.peek() == Some(byte) {
            self.at += 1;
            true
        } else {
            false
        }
    }

    fn value(&mut self, depth: usize) -> Option<Value> {
        if depth > MAX_DEPTH {
            return None;
        }
        self.skip_space();
        match self.peek()? {
            b'{' => self.dict(depth),
            b'[' => self.sequence(b']', depth),
            b'(' => self.sequence(b')', depth),
            b'\'' | b'"' => self.string().map(Value::String),
            b'-' | b'+' | b'0'..=b'9' | b'.' => self.number(),
            b if b.is_ascii_alphabetic() || b == b'_' => self.name_or_call(depth),
            _ => None,
        }
    }

    fn dict(&mut self, depth: usize) -> Option<Value> {
        self.at += 1;
        let mut map = Map::new();
        loop {
            if self.eat(b'}') {
                return Some(Value::Object(map));
            }
            let key = match self.value(depth + 1)? {
                Value::String(s) => s,
                other => other.to_string(),
            };
            if !self.eat(b':') {
                return None;
            }
            let value = self.value(depth + 1)?;
            map.insert(key, value);
            if !self.eat(b',') {
                return self.eat(b'}').then_some(Value::Object(map));
            }
        }
    }

    fn sequence(&mut self, close: u8, depth: usize) -> Option<Value> {
        self.at += 1;
        let mut items = Vec::new();
        loop {
            if self.eat(close) {
                return Some(Value::Array(items));
            }
            items.push(self.value(depth + 1)?);
            if !self.eat(b',') {
                return self.eat(close).then_some(Value::Array(items));
            }
        }
    }

    /// A quoted string, its escapes read (`\n`, `\t`, `\\`, quotes, `\xNN`, `\uNNNN`).
    fn string(&mut self) -> Option<String> {
        let quote = self.peek()?;
        self.at += 1;
        let mut out: Vec<u8> = Vec::new();
        loop {
            let byte = self.peek()?;
            self.at += 1;
            match byte {
                b if b == quote => return String::from_utf8(out).ok(),
                b'\\' => {
                    let escaped = self.peek()?;
                    self.at += 1;
                    match escaped {
                        b'n' => out.push(b'\n'),
                        b't' => out.push(b'\t'),
                        b'r' => out.push(b'\r'),
                        b'x' | b'u' | b'U' => {
                            let digits = match escaped {
                                b'x' => 2,
                                b'u' => 4,
                                _ => 8,
                            };
                            let hex = self.text.get(self.at..self.at + digits)?;
                            let code =
                                u32::from_str_radix(std::str::from_utf8(hex).ok()?, 16).ok()?;
                            let mut buffer = [0; 4];
                            out.extend(char::from_u32(code)?.encode_utf8(&mut buffer).as_bytes());
                            self.at += digits;
                        }
                        other => out.push(other),
                    }
                }
                b => out.push(b),
            }
        }
    }

    fn number(&mut self) -> Option<Value> {
        let start = self.at;
        while self
            .peek()
            .is_some_and(|b| b.is_ascii_digit() || matches!(b, b'-' | b'+' | b'.' | b'e' | b'E'))
        {
            self.at += 1;
        }
        let text = std::str::from_utf8(&self.text[start..self.at]).ok()?;
        number_value(text)
    }

    /// `None`, `True`, `False`, or a call such as `Decimal('1.5')`: its arguments read as the
    /// value it stands for.
    fn name_or_call(&mut self, depth: usize) -> Option<Value> {
        let start = self.at;
        while self
            .peek()
            .is_some_and(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.'))
        {
            self.at += 1;
        }
        let name = std::str::from_utf8(&self.text[start..self.at])
            .ok()?
            .to_owned();
        self.skip_space();
        if self.peek() != Some(b'(') {
            return match name.as_str() {
                "None" => Some(Value::Null),
                "True" => Some(Value::Bool(true)),
                "False" => Some(Value::Bool(false)),
                _ => Some(Value::String(name)),
            };
        }
        self.at += 1;
        let mut args = Vec::new();
        let mut keywords = false;
        loop {
            if self.eat(b')') {
                break;
            }
            // A keyword argument (`tzinfo=…`) is read and left out.
            let mark = self.at;
            let keyword = self.keyword();
            keywords |= keyword;
            let value = self.value(depth + 1)?;
            if !keyword {
                args.push(value);
            }
            if mark == self.at {
                return None;
            }
            if !self.eat(b',') {
                if !self.eat(b')') {
                    return None;
                }
                break;
            }
        }
        let source = std::str::from_utf8(&self.text[start..self.at]).ok()?;
        Some(called(&name, &args, keywords).unwrap_or_else(|| Value::String(source.to_owned())))
    }

    /// Skips `name=` when the next argument is a keyword argument.
    fn keyword(&mut self) -> bool {
        self.skip_space();
        let start = self.at;
        let mut end = start;
        while self
            .text
            .get(end)
            .is_some_and(|b| b.is_ascii_alphanumeric() || *b == b'_')
        {
            end += 1;
        }
        if end > start && self.text.get(end) == Some(&b'=') && self.text.get(end + 1) != Some(&b'=')
        {
            self.at = end + 1;
            return true;
        }
        false
    }
}

/// A number as JSON: an integer that fits, a float, or (an integer too large for JSON
/// numbers to keep exact) its digits as a string.
fn number_value(text: &str) -> Option<Value> {
    if let Ok(int) = text.parse::<i64>() {
        return Some(Value::Number(int.into()));
    }
    let digits = text.strip_prefix(['-', '+']).unwrap_or(text);
    if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) {
        return Some(Value::String(text.to_owned()));
    }
    let float = text.parse::<f64>().ok()?;
    Number::from_f64(float).map(Value::Number)
}

/// The value a call stands for, when it says it whole: a date (or a time to the second, no
/// zone) as ISO 8601, a `Decimal` or `UUID` as its text. `None` for anything else, which is
/// kept as its source text.
fn called(name: &str, args: &[Value], keywords: bool) -> Option<Value> {
    if keywords {
        return None;
    }
    let ints: Option<Vec<i64>> = args.iter().map(Value::as_i64).collect();
    let short = name.rsplit('.').next().unwrap_or(name);
    match (short, ints.as_deref(), args) {
        ("date", Some([y, m, d]), _) => Some(Value::String(format!("{y:04}-{m:02}-{d:02}"))),
        ("datetime", Some([y, m, d, time @ ..]), _) if time.len() <= 3 => {
            let [h, mi, s] = [0, 1, 2].map(|i| time.get(i).copied().unwrap_or(0));
            Some(Value::String(format!(
                "{y:04}-{m:02}-{d:02}T{h:02}:{mi:02}:{s:02}"
            )))
        }
        ("Decimal" | "UUID", _, [Value::String(text)]) => Some(Value::String(text.clone())),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_bare_envelope_is_what_it_wraps_when_it_says_nothing_else() {
        // FastMCP: a text part holding a result whose structured content repeats its parts.
        let result = json!({"meta": null, "content": [{"type": "text", "text": "No results",
            "annotations": null, "meta": null}], "structuredContent": {"result": [{"type": "text",
            "text": "No results", "annotations": null, "_meta": null}]}, "isError": false});
        let part = json!({"type": "text", "text": result.to_string(), "annotations": null,
            "meta": null});
        assert_eq!(bare(&part.to_string()).as_deref(), Some("No results"));
        // Structured content that is the JSON of the one text part.
        let rows = r#"{"rows":[[1,"Ann"]]}"#;
        let result = json!({"content": [{"type": "text", "text": rows}],
            "structuredContent": {"rows": [[1, "Ann"]]}});
        assert_eq!(bare(&result.to_string()).as_deref(), Some(rows));
    }

    #[test]
    fn an_envelope_that_says_more_than_its_text_stays() {
        let said_more = [
            // an error
            json!({"content": [{"type": "text", "text": "denied"}], "isError": true}),
            // structured content of its own
            json!({"content": [{"type": "text", "text": "2 rows"}],
                "structuredContent": {"rows": [[1], [2]]}}),
            // annotations that are not null
            json!({"type": "text", "text": "x", "annotations": {"audience": ["user"]}}),
            // a part that is not text
            json!({"content": [{"type": "image", "data": "AAAA", "mimeType": "image/png"}]}),
            // another field
            json!({"content": [{"type": "text", "text": "x"}], "nextCursor": "c2"}),
            // parts whose line breaks would blur where one ends
            json!({"content": [{"type": "text", "text": "a\nb"}, {"type": "text", "text": "c"}]}),
            // nothing but blank text
            json!({"content": [{"type": "text", "text": " "}]}),
        ];
        for envelope in said_more {
            assert_eq!(bare(&envelope.to_string()), None, "{envelope}");
        }
        assert_eq!(bare("No results"), None);
        assert_eq!(bare(r#"{"id": 7}"#), None);
        assert_eq!(bare(r#"[{"type": "text", "text": "x"}]"#), None);
    }

    #[test]
    fn an_envelope_is_opened_however_its_keys_are_written() {
        // Keys written with escapes (`\u0074ext` is `text`) are the same keys.
        let escaped = r#"{"\u0063ontent": [{"type": "text", "\u0074ext": "No results"}]}"#;
        assert_eq!(bare(escaped).as_deref(), Some("No results"));
        let spaced = "  \n {\"content\": [{\"type\": \"text\", \"text\": \"42 rows\"}]}";
        assert_eq!(bare(spaced).as_deref(), Some("42 rows"));
        assert!(!may_be_envelope(
            r#"{"rows": [[1, "Ann"]], "contents": "texts"}"#
        ));
        assert!(may_be_envelope(r#"{"rows": [[1, "Ann"]], "content": []}"#));
    }

    #[test]
    fn opens_mcp_envelopes_down_to_the_result() {
        let inner =
            r#"{"server_name":"GitHub","data":[{"sha":"9960874","author":{"login":"zjwu0522"}}]}"#;
        let result = json!({"meta": null, "content": [{"type": "text", "text": inner, "annotations": null, "meta": null}],
            "structuredContent": null, "isError": false});
        let part = json!({"type": "text", "text": result.to_string()});
        assert_eq!(
            tree(&part.to_string()),
            Some(
                json!({"server_name": "GitHub", "data": [{"sha": "9960874", "author": {"login": "zjwu0522"}}]})
            )
        );
        // A list of text parts, as a chat message's content carries them.
        let parts = json!([{"type": "text", "text": "[1, 2]"}, {"type": "text", "text": "[3]"}]);
        assert_eq!(
            read(&parts.to_string()),
            Payload::Text(Cow::Borrowed("[1, 2]\n[3]"))
        );
        // Text inside an envelope is text.
        let wrapped = json!({"type": "text", "text": "No results"});
        assert_eq!(
            read(&wrapped.to_string()),
            Payload::Text(Cow::Borrowed("No results"))
        );
    }

    #[test]
    fn leaves_objects_that_only_look_like_envelopes() {
        let object = json!({"type": "text", "text": "hello", "author": "Mia"});
        assert_eq!(tree(&object.to_string()), Some(object));
        let page = json!({"content": [1, 2], "title": "Page 2"});
        assert_eq!(tree(&page.to_string()), Some(page));
        // An error, or a part that is not text, keeps the envelope: nothing of it is lost.
        let error =
            json!({"content": [{"type": "text", "text": "{\"code\": 404}"}], "isError": true});
        assert_eq!(tree(&error.to_string()), Some(error));
        let resource = json!({"content": [{"type": "text", "text": "see file"},
            {"type": "resource", "resource": {"uri": "file:///a.txt", "text": "A1 B2"}}]});
        assert_eq!(tree(&resource.to_string()), Some(resource));
        assert_eq!(
            read("plain words"),
            Payload::Text(Cow::Borrowed("plain words"))
        );
    }

    #[test]
    fn reads_what_database_tools_print() {
        let rows = "[{'department_name': 'Finance', 'manager_start_date': datetime.date(1989, 12, 17), \
                    'tenure_years': Decimal('35.8'), 'current_employees': 12437, 'active': True, \
                    'note': None, 'at': datetime.datetime(2024, 5, 1, 9, 30)}]";
        assert_eq!(
            python_literal(rows),
            Some(
                json!([{"department_name": "Finance", "manager_start_date": "1989-12-17",
                "tenure_years": "35.8", "current_employees": 12437, "active": true, "note": null,
                "at": "2024-05-01T09:30:00"}])
            )
        );
        assert_eq!(
            python_literal(r#"("it's", 'say "hi"', -1.5e3, (1,))"#),
            Some(json!(["it's", "say \"hi\"", -1500.0, [1]]))
        );
        // What a plain date or time cannot say whole is kept as it was written.
        assert_eq!(
            python_literal(
                "[datetime.datetime(2024, 5, 1, 9, 30, 15, 123456, tzinfo=datetime.timezone.utc), \
                 datetime.timedelta(days=3), 12345678901234567890, '\\U0001F600']"
            ),
            Some(json!([
                "datetime.datetime(2024, 5, 1, 9, 30, 15, 123456, tzinfo=datetime.timezone.utc)",
                "datetime.timedelta(days=3)",
                "12345678901234567890",
                "😀"
            ]))
        );
        assert_eq!(python_literal("{'a': 1"), None);
        assert_eq!(python_literal("[1, 2] trailing"), None);
        assert_eq!(python_literal("Decimal('1.5')"), None);
        let deep = "[".repeat(1_000) + &"]".repeat(1_000);
        assert_eq!(python_literal(&deep), None);
    }

    #[test]
    fn a_python_result_in_an_envelope_is_a_tree() {
        let result = json!({"content": [{"type": "text", "text": "[{'avg': Decimal('29.1')}]"}], "isError": false});
        assert_eq!(tree(&result.to_string()), Some(json!([{"avg": "29.1"}])));
    }
}
