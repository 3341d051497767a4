//! `Deserialize` for the wire types that keep the fields ctxproxy does not know in `extra`.
//!
//! `#[serde(flatten)]` would do it, but it buffers every field of the struct into serde's
//! generic content tree before reading it again: each message's text parsed twice and copied
//! once more, a seventh of a warm request's work. These read the JSON object once: a known key
//! goes to its field, any other key to `extra`, in the order it was written. Errors are the
//! derive's: `missing field`, `duplicate field`, and `invalid type: …, expected struct Name`.

use std::borrow::Cow;
use std::fmt;

use serde::Deserializer;
use serde::de::{self, DeserializeSeed, Visitor};

/// A key of a JSON object, borrowed from the input when it has no escapes.
pub(super) struct Key;

impl<'de> DeserializeSeed<'de> for Key {
    type Value = Cow<'de, str>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for Key {
    type Value = Cow<'de, str>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a field name")
    }

    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(Cow::Borrowed(v))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(Cow::Owned(v.to_owned()))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
        Ok(Cow::Owned(v))
    }
}

/// `impl Deserialize for $ty`: `required` fields (an error when absent), `optional` fields
/// (their `Default` when absent: `Nullable::Absent`, `None`), each `field: "key"`, and every
/// other key into the `extra` map.
macro_rules! deserialize_with_extra {
    (
        $ty:ident,
        required { $($req:ident: $req_key:literal),* $(,)? },
        optional { $($opt:ident: $opt_key:literal),* $(,)? } $(,)?
    ) => {
        impl<'de> serde::Deserialize<'de> for $ty {
            fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                struct Fields;
                impl<'de> serde::de::Visitor<'de> for Fields {
                    type Value = $ty;

                    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                        f.write_str(concat!("struct ", stringify!($ty)))
                    }

                    fn visit_map<A: serde::de::MapAccess<'de>>(
                        self,
                        mut map: A,
                    ) -> Result<$ty, A::Error> {
                        use serde::de::Error as _;
                        $(let mut $req = None;)*
                        $(let mut $opt = None;)*
                        let mut extra = $crate::openai::Extra::new();
                        while let Some(key) = map.next_key_seed($crate::openai::with_extra::Key)? {
                            match &*key {
                                $($req_key => {
                                    if $req.is_some() {
                                        return Err(A::Error::duplicate_field($req_key));
                                    }
                                    $req = Some(map.next_value()?);
                                })*
                                $($opt_key => {
                                    if $opt.is_some() {
                                        return Err(A::Error::duplicate_field($opt_key));
                                    }
                                    $opt = Some(map.next_value()?);
                                })*
                                _ => {
                                    let value = map.next_value()?;
                                    extra.insert(key.into_owned(), value);
                                }
                            }
                        }
                        Ok($ty {
                            $($req: $req.ok_or_else(|| A::Error::missing_field($req_key))?,)*
                            $($opt: $opt.unwrap_or_default(),)*
                            extra,
                        })
                    }
                }
                deserializer.deserialize_map(Fields)
            }
        }
    };
}

pub(super) use deserialize_with_extra;

#[cfg(test)]
mod tests {
    use serde_json::json;

    use crate::openai::{ChatRequest, Message, Nullable, Role};

    #[test]
    fn unknown_fields_are_kept_in_the_order_written_at_every_level() {
        let body = r#"{"z":1,"model":"m","a":{"b":[2]},"messages":[
            {"role":"user","content":"hi","x-last":true,"cache_control":{"type":"ephemeral"}},
            {"role":"assistant","tool_calls":[{"id":"c","function":{"name":"f","arguments":"{}","strict":1},"index":0}]}
        ],"tools":[{"type":"function","function":{"name":"f","x":null},"y":"z"}]}"#;
        let chat: ChatRequest = serde_json::from_str(body).unwrap();
        let keys = |extra: &crate::openai::Extra| extra.keys().cloned().collect::<Vec<_>>();
        assert_eq!(keys(&chat.extra), ["z", "a"]);
        assert_eq!(keys(&chat.messages[0].extra), ["x-last", "cache_control"]);
        let call = &chat.messages[1].tool_calls()[0];
        assert_eq!(keys(&call.extra), ["index"]);
        assert_eq!(keys(&call.function.extra), ["strict"]);
        let tool = &chat.tools.get().unwrap()[0];
        assert_eq!(keys(&tool.extra), ["y"]);
        assert_eq!(
            keys(&tool.function.as_ref().unwrap().extra),
            ["x"],
            "an unknown null is kept"
        );
        let written = serde_json::to_value(&chat).unwrap();
        assert_eq!(
            written,
            serde_json::from_str::<serde_json::Value>(body).unwrap()
        );
        // A copy keeps them too (`Clone` makes an empty map anew, copies one that is not).
        let copy = chat.clone();
        assert_eq!(copy, chat);
        assert_eq!(serde_json::to_value(&copy).unwrap(), written);
    }

    #[test]
    fn an_escaped_key_is_read_as_the_key_it_spells() {
        let message: Message =
            serde_json::from_str(r#"{"r\u006fle":"tool","n\u00e4me":1,"content":"x"}"#).unwrap();
        assert_eq!(message.role, Role::Tool);
        assert_eq!(message.extra.get("näme"), Some(&json!(1)));
    }

    #[test]
    fn absent_null_and_set_stay_apart() {
        let read = |body: &str| serde_json::from_str::<Message>(body).unwrap().name;
        assert_eq!(read(r#"{"role":"user"}"#), Nullable::Absent);
        assert_eq!(read(r#"{"role":"user","name":null}"#), Nullable::Null);
        assert_eq!(
            read(r#"{"role":"user","name":"a"}"#),
            Nullable::Value("a".into())
        );
    }

    #[test]
    fn errors_are_the_derives() {
        let error = |body: &str| {
            serde_json::from_str::<Message>(body)
                .unwrap_err()
                .to_string()
        };
        assert!(error(r#"{"content":"x"}"#).starts_with("missing field `role`"));
        assert!(error(r#"{"role":"user","role":"tool"}"#).starts_with("duplicate field `role`"));
        assert!(
            error(r#"{"role":"user","content":"a","content":"b"}"#)
                .starts_with("duplicate field `content`")
        );
        assert!(error(r#"["user"]"#).contains("expected struct Message"));
        assert!(error(r#"{"role":"user","content":5}"#).contains("invalid type: integer `5`"));
        let chat = serde_json::from_str::<ChatRequest>(r#"{"model":"m"}"#).unwrap_err();
        assert!(chat.to_string().starts_with("missing field `messages`"));
    }
}
