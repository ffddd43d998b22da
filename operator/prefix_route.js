// The PrefixHash load balancer's router (njs, NGINX's JavaScript module), served from the operator's ConfigMap.
// It reads the request body (kept in memory: client_body_buffer_size), makes the routing key from the model name
// and the start of the prompt, and hands the request to the consistent-hash upstream. A body without a key
// (not JSON, no prompt, a GET) goes to least connections instead, never to an error.

// The text whose start identifies a conversation: system prompts and the first user message (chat), the prompt
// (completions), the input (embeddings). Token-id prompts count by their JSON.
function promptText(body) {
    if (Array.isArray(body.messages)) {
        let system = '';
        for (let i = 0; i < body.messages.length; i++) {  // (njs before 0.8 has no for...of)
            const m = body.messages[i];
            if (m === null || typeof m !== 'object') return null;
            if (m.role === 'system' || m.role === 'developer') {
                system += contentText(m.content);
            } else if (m.role === 'user') {
                return system + '\n' + contentText(m.content);
            }
        }
        return system || null;
    }
    let p = body.prompt !== undefined ? body.prompt : body.input;
    if (Array.isArray(p) && p.length > 0 && typeof p[0] !== 'number') p = p[0];
    if (typeof p === 'string') return p;
    return p === undefined || p === null ? null : JSON.stringify(p);
}

function contentText(content) {
    if (typeof content === 'string') return content;
    if (!Array.isArray(content)) return '';
    return content.map((part) => (part && part.type === 'text' && typeof part.text === 'string') ? part.text : '').join('');
}

// The routing key of a request body: the model name (adapters route apart) and the first `characters` of its
// prompt text; '' when it has none.
function routingKey(requestText, characters) {
    let body;
    try {
        body = JSON.parse(requestText);
    } catch (e) {
        return '';  // not JSON, or the body was not in memory
    }
    if (body === null || typeof body !== 'object' || typeof body.model !== 'string') return '';
    const text = promptText(body);
    return text ? body.model + '\n' + text.slice(0, characters) : '';
}

function route(r) {
    let body;
    try {
        body = r.requestText;
    } catch (e) {
        body = undefined;  // not in memory (client_body_buffer_size keeps it there): no key
    }
    const key = routingKey(body, Number(r.variables.pagekube_prefix_characters));
    if (key) {
        r.variables.pagekube_route_key = key;
        r.internalRedirect('@prefix');
    } else {
        r.internalRedirect('@least');
    }
}

export default {route, routingKey};
