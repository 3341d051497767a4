//! Name patterns (`gpt-*`, `qwen?`) for models and tools: a leaf the config, the metrics and
//! the pipeline stages all match names with, so none of them imports another for it.

/// `*` matches any run of characters, `?` one character; everything else is literal.
pub fn glob_match(pattern: &str, text: &str) -> bool {
    let (p, t): (Vec<char>, Vec<char>) = (pattern.chars().collect(), text.chars().collect());
    let (mut pi, mut ti) = (0, 0);
    let mut backtrack: Option<(usize, usize)> = None;
    while ti < t.len() {
        match p.get(pi) {
            Some('*') => {
                backtrack = Some((pi, ti));
                pi += 1;
            }
            Some(&c) if c == '?' || c == t[ti] => {
                pi += 1;
                ti += 1;
            }
            _ => match backtrack {
                Some((star, matched)) => {
                    pi = star + 1;
                    ti = matched + 1;
                    backtrack = Some((star, matched + 1));
                }
                None => return false,
            },
        }
    }
    p[pi..].iter().all(|&c| c == '*')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glob() {
        assert!(glob_match("gpt-*", "gpt-4o"));
        assert!(glob_match("*", ""));
        assert!(glob_match("*-mini", "gpt-4o-mini"));
        assert!(glob_match("a*b*c", "aXbYbZc"));
        assert!(!glob_match("gpt-*", "chatgpt-4o"));
        assert!(!glob_match("gpt-4o", "gpt-4o-mini"));
    }
}
