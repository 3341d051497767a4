//! The categories of the tools a request offers: configured ones (`[[tools.categories]]`), and
//! for unclaimed tools one derived from the tool's name, with the words that call for each.

use std::collections::BTreeMap;
use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::{Arc, LazyLock};

use foldhash::quality::FixedState;

use crate::bounded::Weigh;
use crate::glob::glob_match;
use crate::openai::Tool;
use crate::pipeline::config::ToolsConfig;
use crate::pipeline::memo::Memo;
use crate::pipeline::text::{content_words, first_sentence, name_segments, normalize};

/// Verbs common to whole APIs: they say nothing about which part of the API is meant.
const GENERIC_VERBS: &[&str] = &[
    "get", "list", "create", "update", "delete", "search", "fetch", "set", "add", "remove", "find",
    "show", "read", "write", "put", "post", "patch", "compare", "check",
];

/// Words people use for what a tool name says (English and Spanish). A derived category whose
/// tool names contain one word of a group also gets the others as keywords: `update_*` is
/// also called for by "change" and "cambiar", `transfer_to_human_agents` by "supervisor".
/// Only name words trigger a group (descriptions are too loose).
const SYNONYMS: &[&[&str]] = &[
    &[
        "update",
        "change",
        "modify",
        "edit",
        "alter",
        "amend",
        "upgrade",
        "downgrade",
        "reschedule",
        "cambiar",
        "cambio",
        "modificar",
        "actualizar",
        "editar",
    ],
    &["cancel", "revoke", "annul", "cancelar", "anular"],
    &["delete", "remove", "erase", "borrar", "eliminar", "quitar"],
    &[
        "create", "add", "new", "crear", "nuevo", "nueva", "agregar", "anadir",
    ],
    &["book", "reserve", "purchase", "buy", "reservar", "comprar"],
    &[
        "search",
        "find",
        "look for",
        "available",
        "availability",
        "buscar",
        "encontrar",
        "disponible",
    ],
    &["send", "enviar", "mandar"],
    &[
        "refund",
        "compensation",
        "reimburse",
        "reembolso",
        "reembolsar",
        "compensacion",
    ],
    &["transfer", "escalate", "transferir"],
    &[
        "human",
        "agent",
        "person",
        "someone",
        "supervisor",
        "manager",
        "representative",
        "speak",
        "talk",
        "humano",
        "persona",
        "alguien",
        "encargado",
        "hablar",
    ],
    &["user", "profile", "account", "usuario", "perfil", "cuenta"],
];

/// The synonym groups as keyword phrases, normalized like message words.
static SYNONYM_KEYWORDS: LazyLock<Vec<Vec<Vec<String>>>> = LazyLock::new(|| {
    SYNONYMS
        .iter()
        .map(|group| group.iter().map(|w| keyword_words(w)).collect())
        .collect()
});

/// A derived keyword found in more categories than this shares its weight among them: alone
/// it no longer selects any ("repository" in every GitHub tool's description).
const SHARED_KEYWORD_CATEGORIES: usize = 2;

#[derive(Debug, Clone, PartialEq)]
pub struct Keyword {
    /// Folded, stemmed words (a phrase has several).
    pub words: Vec<String>,
    /// What a match adds to the category's score: 1, or less for a derived keyword many
    /// categories share.
    pub weight: f64,
    /// From a tool name (or a synonym of a name word), not only from a description.
    pub named: bool,
}

impl Keyword {
    fn new(words: Vec<String>, named: bool) -> Keyword {
        Keyword {
            words,
            weight: 1.0,
            named,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Category {
    pub name: String,
    pub keywords: Vec<Keyword>,
    /// Names of the request's tools in this category.
    pub tools: Vec<String>,
}

#[derive(Debug, Default)]
pub struct Catalog {
    pub categories: Vec<Category>,
    /// A hash of what it was built from (tools and config), for memo keys derived from it.
    pub key: u64,
}

impl Weigh for Catalog {
    fn heap_bytes(&self) -> usize {
        self.categories.heap_bytes()
    }
}

impl Weigh for Category {
    fn heap_bytes(&self) -> usize {
        self.name.heap_bytes() + self.keywords.heap_bytes() + self.tools.heap_bytes()
    }
}

impl Weigh for Keyword {
    fn heap_bytes(&self) -> usize {
        self.words.heap_bytes()
    }
}

pub fn tool_name(tool: &Tool) -> Option<&str> {
    tool.function.as_ref().map(|f| f.name.as_str())
}

/// Words of a keyword or phrase, folded and stemmed like message words.
pub fn keyword_words(keyword: &str) -> Vec<String> {
    content_words(keyword)
}

/// A name of one word (`think`, `calculate`, `Finish`): an agent utility, not part of an API.
pub fn is_single_word(name: &str) -> bool {
    name_segments(name).len() == 1 && !name.contains("__")
}

/// The namespace a tool name declares: before the first separator, or the server of an MCP
/// tool (`mcp__jira__search` → `jira`).
pub fn namespace(name: &str) -> String {
    let parts: Vec<&str> = name.split("__").filter(|p| !p.is_empty()).collect();
    let base = match parts.as_slice() {
        [first, server, _, ..] if first.eq_ignore_ascii_case("mcp") => server,
        [first, ..] => first,
        [] => name,
    };
    name_segments(base)
        .first()
        .map_or_else(|| normalize(name), |s| normalize(s))
}

/// Seed of the memo keys of catalogs.
const CATALOG_SEED: u64 = 0x6361_7461_6c6f_0001;

impl Catalog {
    /// The catalog of `tools` under `config`, built once per distinct input (what it reads:
    /// tool names and descriptions, and the configured categories) and then shared.
    pub fn memoized(tools: &[Tool], config: &ToolsConfig, memo: &Memo) -> Arc<Catalog> {
        let mut hasher = FixedState::with_seed(CATALOG_SEED).build_hasher();
        tools.len().hash(&mut hasher);
        for tool in tools {
            let function = tool.function.as_ref();
            function.map(|f| f.name.as_str()).hash(&mut hasher);
            function.and_then(|f| f.description.get()).hash(&mut hasher);
        }
        config.derived_max_tools.hash(&mut hasher);
        for category in &config.categories {
            (&category.name, &category.keywords, &category.tools).hash(&mut hasher);
        }
        let key = hasher.finish();
        memo.catalog(key, || Catalog {
            key,
            ..Catalog::build(tools, config)
        })
    }

    pub fn build(tools: &[Tool], config: &ToolsConfig) -> Catalog {
        let mut categories: Vec<Category> = config
            .categories
            .iter()
            .map(|c| Category {
                name: c.name.clone(),
                keywords: c
                    .keywords
                    .iter()
                    .map(|k| Keyword::new(keyword_words(k), true))
                    .collect(),
                tools: Vec::new(),
            })
            .collect();
        // Derived categories by namespace: name → (tool names, descriptions).
        let mut derived: BTreeMap<String, Vec<&Tool>> = BTreeMap::new();
        for tool in tools {
            let Some(name) = tool_name(tool) else {
                continue;
            };
            let mut claimed = false;
            for (category, configured) in categories.iter_mut().zip(&config.categories) {
                if configured.tools.iter().any(|p| glob_match(p, name)) {
                    category.tools.push(name.to_owned());
                    claimed = true;
                }
            }
            if !claimed {
                derived.entry(namespace(name)).or_default().push(tool);
            }
        }
        categories.retain(|c| !c.tools.is_empty());
        let configured = categories.len();
        for (space, members) in derived {
            if members.len() > config.derived_max_tools.max(1) {
                // One namespace for a whole API (github_*): split by what each tool acts on.
                let mut parts: BTreeMap<String, Vec<&Tool>> = BTreeMap::new();
                for tool in members {
                    let object = tool_name(tool)
                        .and_then(|n| name_segments(n).last().map(|s| keyword_words(s)))
                        .and_then(|w| w.into_iter().next())
                        .unwrap_or_else(|| space.clone());
                    parts.entry(object).or_default().push(tool);
                }
                for (object, members) in parts {
                    categories.push(derived_category(
                        format!("{space}.{object}"),
                        &members,
                        Some(&space),
                    ));
                }
            } else {
                categories.push(derived_category(space, &members, None));
            }
        }
        share_common_keywords(&mut categories[configured..]);
        Catalog { categories, key: 0 }
    }

    /// The categories a tool belongs to.
    pub fn categories_of<'a>(&'a self, tool: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.categories
            .iter()
            .filter(move |c| c.tools.iter().any(|t| t == tool))
            .map(|c| c.name.as_str())
    }
}

/// A category made from tool names and the first sentence of their descriptions. In a split
/// namespace the namespace word and generic verbs are left out: they name every part.
fn derived_category(name: String, tools: &[&Tool], split_from: Option<&str>) -> Category {
    let mut keywords: Vec<Keyword> = Vec::new();
    let mut add = |words: Vec<String>, named: bool| {
        let generic = split_from.is_some_and(|space| {
            words.len() == 1 && (words[0] == space || GENERIC_VERBS.contains(&words[0].as_str()))
        });
        if generic || words.is_empty() {
            return;
        }
        match keywords.iter_mut().find(|k| k.words == words) {
            Some(known) => known.named |= named,
            None => keywords.push(Keyword::new(words, named)),
        }
    };
    for tool in tools {
        let Some(function) = &tool.function else {
            continue;
        };
        for segment in name_segments(&function.name) {
            for word in keyword_words(segment) {
                for group in SYNONYM_KEYWORDS
                    .iter()
                    .filter(|g| g.contains(&vec![word.clone()]))
                {
                    for synonym in group {
                        add(synonym.clone(), true);
                    }
                }
                add(vec![word], true);
            }
        }
        if let Some(description) = function.description.get() {
            for word in keyword_words(&first_sentence(description, 30)) {
                add(vec![word], false);
            }
        }
    }
    Category {
        name,
        keywords,
        tools: tools
            .iter()
            .filter_map(|t| tool_name(t).map(str::to_owned))
            .collect(),
    }
}

/// Divides the weight of a derived keyword that more than `SHARED_KEYWORD_CATEGORIES`
/// categories have among them, like inverse document frequency, except in the category it
/// names. A name word is shared only with other names (`user` in `get_user_details` stays
/// strong though many descriptions say "the user").
fn share_common_keywords(derived: &mut [Category]) {
    let mut in_names: BTreeMap<Vec<String>, usize> = BTreeMap::new();
    let mut anywhere: BTreeMap<Vec<String>, usize> = BTreeMap::new();
    for category in derived.iter() {
        for keyword in &category.keywords {
            *anywhere.entry(keyword.words.clone()).or_default() += 1;
            if keyword.named {
                *in_names.entry(keyword.words.clone()).or_default() += 1;
            }
        }
    }
    for category in derived.iter_mut() {
        // The word that names the category (`book`, `github.issue` → issue) keeps its weight.
        let own = category
            .name
            .rsplit('.')
            .next()
            .unwrap_or_default()
            .to_owned();
        for keyword in &mut category.keywords {
            let frequency = if keyword.named { &in_names } else { &anywhere };
            let shared_by = frequency.get(&keyword.words).copied().unwrap_or(1);
            if shared_by > SHARED_KEYWORD_CATEGORIES && keyword.words != [own.as_str()] {
                keyword.weight = 1.0 / shared_by as f64;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tools(names: &[&str]) -> Vec<Tool> {
        names
            .iter()
            .map(|n| {
                serde_json::from_value(json!({"type": "function", "function": {"name": n,
                    "description": format!("Does {n}.")}}))
                .unwrap()
            })
            .collect()
    }

    #[test]
    fn single_words_are_utilities() {
        assert!(is_single_word("think") && is_single_word("Finish"));
        assert!(!is_single_word("get_weather") && !is_single_word("mcp__x__y"));
        assert!(!is_single_word("getWeather") && !is_single_word("createCalendarEvent"));
    }

    #[test]
    fn namespaces_come_from_names() {
        assert_eq!(namespace("github_list_repos"), "github");
        assert_eq!(namespace("mcp__jira__search"), "jira");
        assert_eq!(namespace("slack.post-message"), "slack");
        assert_eq!(namespace("calculate"), "calculate");
        assert_eq!(namespace("sendEmail"), "send");
    }

    #[test]
    fn configured_categories_claim_tools_and_big_namespaces_split() {
        let config = ToolsConfig {
            categories: vec![crate::pipeline::config::ToolCategory {
                name: "billing".into(),
                keywords: vec!["invoice".into(), "métodos de pago".into()],
                tools: vec!["stripe_*".into()],
            }],
            derived_max_tools: 3,
            ..ToolsConfig::default()
        };
        let offered = tools(&[
            "stripe_create_invoice",
            "github_list_issues",
            "github_create_issue",
            "github_list_pull_requests",
            "github_get_repo",
            "weather",
        ]);
        let catalog = Catalog::build(&offered, &config);
        let names: Vec<&str> = catalog.categories.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "billing",
                "github.issue",
                "github.repo",
                "github.request",
                "weather"
            ]
        );
        assert_eq!(
            catalog.categories[1].tools,
            ["github_list_issues", "github_create_issue"]
        );
        assert_eq!(catalog.categories[0].keywords[1].words, ["metodo", "pago"]);
        assert!(
            !catalog.categories[1]
                .keywords
                .iter()
                .any(|k| k.words == ["github"])
        );
        assert_eq!(
            catalog.categories_of("github_get_repo").collect::<Vec<_>>(),
            ["github.repo"]
        );
    }
}
