"""The engine's SGLang adapter: every contact with SGLang (``contacts.CONTACTS``), the tree subclass,
the attention backends, the hooks and the engine's one assembly (``factory.build_engine``). The core
(``sgl_kvevict.engine``) imports none of this and no SGLang."""
