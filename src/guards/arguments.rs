//! Whether a tool call's arguments satisfy the client's JSON schema, for the tools a request
//! defines only in its messages (a stub in the block, its full definition in a system message:
//! `pipeline::tools::inline`). A chat template that drops a system message in mid-conversation
//! leaves the model with the stub, and its call (typically `{}`) fails the schema: such a call
//! is asked again with the tool in full in the block, like a call to a stub
//! (`server::guarded::expand`). A tool in full in the block is never checked: its call is the
//! model's answer and the client's business.
//!
//! Pure: no I/O; each tool's validator is compiled at most once per request, and a schema that
//! does not compile (or names a remote `$ref`: nothing is fetched) checks only that the
//! arguments are JSON.

use serde_json::Value;

use crate::openai::Tool;

/// The argument checks of one request: the tools whose calls are checked, and their schemas.
#[derive(Default)]
pub struct ArgumentCheck {
    /// The tools checked now (defined only in the messages of the request being answered).
    checked: Vec<String>,
    /// Every tool checked so far in this request, with its schema, compiled when first used.
    schemas: Vec<Schema>,
}

struct Schema {
    name: String,
    parameters: Option<Value>,
    compiled: Option<Compiled>,
}

enum Compiled {
    Validator(Box<jsonschema::Validator>),
    /// No parameters, or a schema that does not compile: only JSON is asked for.
    AnyJson,
}

/// What a check says of one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Not a checked tool, or its arguments satisfy the schema.
    Valid,
    /// The arguments are not JSON, or fail the schema. `unread`: they name none of the
    /// schema's properties while it requires some, as a model that read only the stub calls it.
    Invalid { unread: bool },
}

/// The checked tools an answer called with arguments that fail their schema.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failed {
    /// In the order called, once each.
    pub tools: Vec<String>,
    /// Some failing call looked made from the stub alone: the model never read the definition.
    pub unread: bool,
}

impl ArgumentCheck {
    /// Checks the calls of `names` from now on, against the schemas of `client` (the client's
    /// tools). A tool checked before keeps its compiled validator.
    pub fn watch(&mut self, client: &[Tool], names: &[String]) {
        for name in names {
            if self.schemas.iter().any(|s| &s.name == name) {
                continue;
            }
            let parameters = client
                .iter()
                .filter_map(|t| t.function.as_ref())
                .find(|f| &f.name == name)
                .and_then(|f| f.parameters.get())
                .map(|p| p.value().clone());
            self.schemas.push(Schema {
                name: name.clone(),
                parameters,
                compiled: None,
            });
        }
        self.checked = names.to_vec();
    }

    /// Whether calls of `name` are checked (and so held in a stream until they are whole).
    pub fn checks(&self, name: &str) -> bool {
        self.checked.iter().any(|c| c == name)
    }

    /// Whether any tool is checked.
    pub fn is_empty(&self) -> bool {
        self.checked.is_empty()
    }

    /// What the check says of a call of `name` with `arguments` (as the model wrote them).
    pub fn judge(&mut self, name: &str, arguments: &str) -> Verdict {
        if !self.checks(name) {
            return Verdict::Valid;
        }
        let Some(schema) = self.schemas.iter_mut().find(|s| s.name == name) else {
            return Verdict::Valid;
        };
        // No arguments at all is an empty object (some models write "" for a call without
        // parameters).
        let parsed = if arguments.trim().is_empty() {
            Ok(Value::Object(serde_json::Map::new()))
        } else {
            serde_json::from_str::<Value>(arguments)
        };
        let Ok(arguments) = parsed else {
            return Verdict::Invalid { unread: false };
        };
        let parameters = schema.parameters.as_ref();
        let compiled = schema.compiled.get_or_insert_with(|| compile(parameters));
        match compiled {
            Compiled::AnyJson => Verdict::Valid,
            Compiled::Validator(validator) if validator.is_valid(&arguments) => Verdict::Valid,
            Compiled::Validator(_) => Verdict::Invalid {
                unread: parameters.is_some_and(|p| unread(p, &arguments)),
            },
        }
    }

    /// The checked tools that `calls` (name, arguments) call with failing arguments; `None`
    /// when every call passes.
    pub fn failing<'a>(
        &mut self,
        calls: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Option<Failed> {
        let mut failed = Failed {
            tools: Vec::new(),
            unread: false,
        };
        for (name, arguments) in calls {
            if let Verdict::Invalid { unread } = self.judge(name, arguments) {
                failed.unread |= unread;
                if !failed.tools.iter().any(|t| t == name) {
                    failed.tools.push(name.to_owned());
                }
            }
        }
        (!failed.tools.is_empty()).then_some(failed)
    }
}

/// A validator of `parameters`; formats are not asserted (they are hints to a model), and
/// nothing is fetched (the crate is built without its resolvers).
fn compile(parameters: Option<&Value>) -> Compiled {
    let Some(parameters) = parameters.filter(|p| p.is_object() || p.is_boolean()) else {
        return Compiled::AnyJson;
    };
    match jsonschema::options()
        .should_validate_formats(false)
        .build(parameters)
    {
        Ok(validator) => Compiled::Validator(Box::new(validator)),
        Err(_) => Compiled::AnyJson,
    }
}

/// Arguments that name none of the schema's properties while it requires some: what a model
/// that was given only the stub (no parameters) writes.
fn unread(parameters: &Value, arguments: &Value) -> bool {
    let requires = parameters["required"]
        .as_array()
        .is_some_and(|r| !r.is_empty());
    let Some(arguments) = arguments.as_object() else {
        return false;
    };
    let properties = parameters["properties"].as_object();
    requires
        && !arguments
            .keys()
            .any(|k| properties.is_some_and(|p| p.contains_key(k)))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn tools() -> Vec<Tool> {
        serde_json::from_value(json!([
            {"type": "function", "function": {"name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                    "days": {"type": "integer"}}, "required": ["city"]}}},
            {"type": "function", "function": {"name": "send_email",
                "parameters": {"type": "object", "properties": {"to": {"type": "string",
                    "format": "email"}}}}},
            {"type": "function", "function": {"name": "ping"}},
            {"type": "function", "function": {"name": "remote",
                "parameters": {"$ref": "https://example.com/schema.json"}}},
            {"type": "function", "function": {"name": "full_one",
                "parameters": {"type": "object", "required": ["x"]}}}
        ]))
        .unwrap()
    }

    fn check(names: &[&str]) -> ArgumentCheck {
        let mut check = ArgumentCheck::default();
        let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
        check.watch(&tools(), &names);
        check
    }

    #[test]
    fn arguments_that_satisfy_the_schema_pass() {
        let mut check = check(&["get_weather", "send_email"]);
        assert_eq!(
            check.judge("get_weather", r#"{"city":"Paris","days":2}"#),
            Verdict::Valid
        );
        // Formats are hints, not asserted.
        assert_eq!(
            check.judge("send_email", r#"{"to":"not an address"}"#),
            Verdict::Valid
        );
        assert_eq!(check.judge("send_email", ""), Verdict::Valid);
    }

    #[test]
    fn a_missing_required_property_a_wrong_type_or_no_json_fail() {
        let mut check = check(&["get_weather"]);
        // The stub's call: nothing of the schema is named, the model never read it.
        assert_eq!(
            check.judge("get_weather", "{}"),
            Verdict::Invalid { unread: true }
        );
        assert_eq!(
            check.judge("get_weather", r#"{"location":"Paris"}"#),
            Verdict::Invalid { unread: true }
        );
        // A model that read the schema and got it wrong.
        assert_eq!(
            check.judge("get_weather", r#"{"city":"Paris","days":"two"}"#),
            Verdict::Invalid { unread: false }
        );
        assert_eq!(
            check.judge("get_weather", r#"{"days":2}"#),
            Verdict::Invalid { unread: false }
        );
        assert_eq!(
            check.judge("get_weather", r#"{"city": "Par"#),
            Verdict::Invalid { unread: false }
        );
    }

    #[test]
    fn tools_not_checked_are_never_judged() {
        // A tool in full in the block: its call is the model's answer.
        let mut check = check(&["get_weather"]);
        assert_eq!(check.judge("full_one", "{}"), Verdict::Valid);
        assert_eq!(check.judge("full_one", "not json"), Verdict::Valid);
        assert_eq!(check.judge("unknown", "{}"), Verdict::Valid);
    }

    #[test]
    fn without_a_usable_schema_only_json_is_asked_for() {
        let mut check = check(&["ping", "remote"]);
        assert_eq!(check.judge("ping", "{}"), Verdict::Valid);
        assert_eq!(check.judge("ping", "{"), Verdict::Invalid { unread: false });
        // A remote reference is not fetched: the schema does not compile.
        assert_eq!(check.judge("remote", r#"{"a":1}"#), Verdict::Valid);
    }

    #[test]
    fn a_schema_that_refers_to_itself_is_judged_without_looping() {
        let client: Vec<Tool> = serde_json::from_value(json!([
            {"type": "function", "function": {"name": "loop", "parameters": {"$ref": "#"}}},
            {"type": "function", "function": {"name": "tree", "parameters": {
                "type": "object", "properties": {"child": {"$ref": "#"}},
                "required": ["child"]}}}
        ]))
        .unwrap();
        let mut check = ArgumentCheck::default();
        check.watch(&client, &["loop".to_owned(), "tree".to_owned()]);
        assert_eq!(check.judge("loop", r#"{"x":1}"#), Verdict::Valid);
        assert!(matches!(
            check.judge("tree", r#"{"child":{"child":1}}"#),
            Verdict::Invalid { unread: false }
        ));
    }

    #[test]
    fn failing_calls_name_each_tool_once_in_order() {
        let mut check = check(&["get_weather", "send_email", "ping"]);
        let calls = [
            ("send_email", r#"{"to":"a@b.co"}"#),
            ("ping", "{"),
            ("get_weather", "{}"),
            ("ping", "nope"),
            ("full_one", "{}"),
        ];
        assert_eq!(
            check.failing(calls),
            Some(Failed {
                tools: vec!["ping".into(), "get_weather".into()],
                unread: true
            })
        );
        assert_eq!(check.failing([("send_email", "{}")]), None);
    }

    #[test]
    fn a_tool_watched_again_keeps_its_validator_and_unwatched_ones_pass() {
        let mut check = check(&["get_weather"]);
        assert!(matches!(
            check.judge("get_weather", "{}"),
            Verdict::Invalid { .. }
        ));
        check.watch(&tools(), &[]);
        assert!(check.is_empty());
        assert_eq!(check.judge("get_weather", "{}"), Verdict::Valid);
        check.watch(&tools(), &["get_weather".to_owned()]);
        assert_eq!(check.schemas.len(), 1);
        assert!(check.schemas[0].compiled.is_some(), "compiled once");
        assert!(matches!(
            check.judge("get_weather", "{}"),
            Verdict::Invalid { .. }
        ));
    }
}
