from clover_gguf.cli import main

main()
