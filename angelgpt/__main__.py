from angelgpt.cli.app import main

main()
